"""The voice-activity example (examples/vad): Silero VAD served as ONNX and
as TorchScript, state carried explicitly by the client. Both must agree
with each other and with the silero-vad package's own models."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
silero_vad = pytest.importorskip("silero_vad")
pytest.importorskip("onnxruntime")
grpcclient = pytest.importorskip("tritonclient.grpc")

from tests.integration.kserve.live import ROOT, live_server  # noqa: E402

RATE, CHUNK, CONTEXT = 16000, 512, 64


def synthetic_signal() -> tuple[np.ndarray, np.ndarray]:
    """Noise, then a voiced (harmonic, syllable-modulated) stretch, then noise."""
    rng = np.random.default_rng(0)
    t = np.arange(RATE * 2) / RATE
    voice = sum(np.sin(2 * np.pi * f * t) / (k + 1) for k, f in enumerate([150, 300, 450, 600, 900]))
    voiced = (t > 0.6) & (t < 1.6)
    signal = 0.01 * rng.standard_normal(t.size) + 0.5 * voice * (np.sin(2 * np.pi * 3 * t) > -0.2) * voiced
    chunks = signal[: len(signal) // CHUNK * CHUNK].reshape(-1, CHUNK).astype(np.float32)
    return chunks, voiced[: chunks.size].reshape(-1, CHUNK).mean(axis=1) > 0.5


@pytest.fixture(scope="module")
def vad_server(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("vad_build", ROOT / "examples" / "vad" / "build_repository.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    repo = module.build(Path(tmp_path_factory.mktemp("vad")) / "repo")
    with live_server(repo) as live:
        yield live


def _kiln_probs(server, model, chunks):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    state = np.zeros((2, 1, 128), np.float32)
    context = np.zeros((1, CONTEXT), np.float32)
    probs = []
    for chunk in chunks:
        frame = np.concatenate([context, chunk[None]], axis=1)
        tensors = []
        for name, value, datatype in (("input", frame, "FP32"), ("state", state, "FP32"),
                                      ("sr", np.array(RATE, np.int64), "INT64")):
            tensor = grpcclient.InferInput(name, list(value.shape), datatype)
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        result = client.infer(model, tensors)
        probs.append(float(result.as_numpy("output")[0, 0]))
        state, context = result.as_numpy("stateN"), frame[:, -CONTEXT:]
    return np.array(probs)


def _package_probs(model, chunks):
    with torch.no_grad():
        return np.array([float(model(torch.from_numpy(c), RATE)) for c in chunks])


def test_onnx_and_torchscript_agree_with_the_package(vad_server):
    chunks, voiced = synthetic_signal()
    served_onnx = _kiln_probs(vad_server, "silero_onnx", chunks)
    served_torch = _kiln_probs(vad_server, "silero_torch", chunks)
    package_onnx = _package_probs(silero_vad.load_silero_vad(onnx=True), chunks)
    package_jit = _package_probs(silero_vad.load_silero_vad(), chunks)
    np.testing.assert_allclose(served_onnx, package_onnx, atol=1e-5)
    np.testing.assert_allclose(served_torch, package_jit, atol=1e-5)
    np.testing.assert_allclose(served_onnx, served_torch, atol=1e-4)
    assert served_onnx[voiced].mean() > 0.2 > served_onnx[~voiced].mean()


def test_metadata_of_both_models(vad_server):
    client = grpcclient.InferenceServerClient(vad_server.grpc_url)
    onnx = client.get_model_metadata("silero_onnx", as_json=True)
    torch_meta = client.get_model_metadata("silero_torch", as_json=True)
    assert [i["name"] for i in onnx["inputs"]] == [i["name"] for i in torch_meta["inputs"]] == ["input", "state", "sr"]
    assert torch_meta["platform"] == "pytorch_libtorch" and onnx["platform"] == "onnxruntime_onnx"
