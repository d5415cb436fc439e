"""The tabular example (examples/tabular): a scikit-learn model exported with
skl2onnx, served with dynamic batching; answers equal scikit-learn's."""
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")
pytest.importorskip("skl2onnx")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from tests.integration.kserve.live import ROOT, live_server  # noqa: E402


def _build_module():
    path = ROOT / "examples" / "tabular" / "build_repository.py"
    spec = importlib.util.spec_from_file_location("tabular_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    build = _build_module()
    model, x_test, _ = build.train()
    repo = build.build(Path(tmp_path_factory.mktemp("tabular")) / "repo")
    with live_server(repo) as live:
        yield live, model, x_test


def test_json_predictions_match_scikit_learn(tabular):
    server, model, x = tabular
    client = httpclient.InferenceServerClient(server.http_url)
    tensor = httpclient.InferInput("input", list(x[:40].shape), "FP32")
    tensor.set_data_from_numpy(x[:40], binary_data=False)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=False) for n in ("label", "probabilities")]
    result = client.infer("breast_cancer", [tensor], outputs=outputs)
    assert result.as_numpy("label").tolist() == model.predict(x[:40]).tolist()
    np.testing.assert_allclose(result.as_numpy("probabilities"), model.predict_proba(x[:40]), atol=1e-5)


def test_single_rows_are_batched_and_match(tabular):
    server, model, x = tabular
    client = grpcclient.InferenceServerClient(server.grpc_url)
    before = client.get_inference_statistics("breast_cancer").model_stats[0].execution_count

    def one(row):
        c = grpcclient.InferenceServerClient(server.grpc_url)
        tensor = grpcclient.InferInput("input", [1, x.shape[1]], "FP32")
        tensor.set_data_from_numpy(row[None])
        return c.infer("breast_cancer", [tensor]).as_numpy("probabilities")[0]

    with ThreadPoolExecutor(16) as pool:
        probs = np.array(list(pool.map(one, x[:64])))
    after = client.get_inference_statistics("breast_cancer").model_stats[0].execution_count
    np.testing.assert_allclose(probs, model.predict_proba(x[:64]), atol=1e-5)
    assert after - before < 64
