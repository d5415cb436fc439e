import asyncio
import io
import json
import zipfile

import numpy as np
import pytest

from kiln.errors import ConfigError
from kiln.serving.backends.torch_archive import check_pt2_archive
from kiln.serving.types import InferRequest
from tests.unit.dataplane.planes import repository_plane
from tests.unit.serving.models import write_model

torch = pytest.importorskip("torch")


class Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, scale):
        y = self.linear(x) * scale
        return y, y.sum(-1, keepdim=True)


IO = {
    "max_batch_size": 8,
    "inputs": [{"name": "X", "datatype": "FP32", "dims": [4]}, {"name": "SCALE", "datatype": "FP32", "dims": [1]}],
    "outputs": [{"name": "Y", "datatype": "FP32", "dims": [3]}, {"name": "TOTAL", "datatype": "FP32", "dims": [1]}],
    "dynamic_batching": {"max_queue_delay_ms": 20},
}


def torchscript_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(Affine()), buffer)
    return buffer.getvalue()


def export_bytes(tmp_path) -> bytes:
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(Affine(), (torch.randn(2, 4), torch.ones(2, 1)),
                                  dynamic_shapes={"x": {0: batch}, "scale": {0: batch}})
    path = tmp_path / "tmp.pt2"
    torch.export.save(program, str(path))
    return path.read_bytes()


def test_torchscript_and_export_models_serve_and_agree(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "ts", {"backend": "torch", **IO}, {1: {"model.pt": torchscript_bytes()}})
    write_model(repo, "ep", {"backend": "torch", **IO}, {1: {"model.pt2": export_bytes(tmp_path)}})
    x = np.random.default_rng(0).random((3, 4), dtype=np.float32)
    scale = np.full((3, 1), 2.0, np.float32)
    with torch.no_grad():
        expected = Affine()(torch.from_numpy(x), torch.from_numpy(scale))[0].numpy()

    async def main():
        plane = repository_plane(repo)
        assert await plane.start() == {}
        out = {}
        for name in ("ts", "ep"):
            rows = await asyncio.gather(*(
                plane.infer(InferRequest(name, {"X": x[i:i + 1], "SCALE": scale[i:i + 1]})) for i in range(3)))
            out[name] = np.concatenate([r.outputs["Y"] for r in rows])
            out[name + "_execs"] = plane.model_statistics(name)[0].execution_count
        await plane.shutdown()
        return out
    out = asyncio.run(main())
    np.testing.assert_allclose(out["ts"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["ep"], expected, rtol=1e-5, atol=1e-6)
    assert out["ts_execs"] < 3 and out["ep_execs"] < 3


def _rewrite_archive(data: bytes, edit) -> bytes:
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            target.writestr(info, edit(info.filename, source.read(info.filename)))
    return out.getvalue()


def test_pt2_archives_that_need_unpickling_are_refused(tmp_path):
    data = export_bytes(tmp_path)

    def pickled_weights(name, content):
        if name.endswith("model_weights_config.json"):
            config = json.loads(content)
            for meta in config["config"].values():
                meta["use_pickle"] = True
            return json.dumps(config).encode()
        return content

    def evil_sample_inputs(name, content):
        if "sample_inputs" in name:
            buffer = io.BytesIO()
            torch.save({"x": Affine}, buffer)  # a class: not loadable with weights_only
            return buffer.getvalue()
        return content

    for edit, fragment in ((pickled_weights, "refusing"), (evil_sample_inputs, "unsafe unpickling")):
        path = tmp_path / f"{edit.__name__}.pt2"
        path.write_bytes(_rewrite_archive(data, edit))
        with pytest.raises(ConfigError, match=fragment):
            check_pt2_archive(path)
    (tmp_path / "junk.pt2").write_bytes(b"junk")
    with pytest.raises(ConfigError, match="not a torch.export archive"):
        check_pt2_archive(tmp_path / "junk.pt2")
    check_pt2_archive(tmp_path / "tmp.pt2")


def test_torch_model_needs_declared_io(tmp_path):
    write_model(tmp_path, "ts", {"backend": "torch"}, {1: {"model.pt": torchscript_bytes()}})

    async def main():
        plane = repository_plane(tmp_path)
        errors = await plane.start()
        await plane.shutdown()
        return errors
    assert "must list its inputs and outputs" in asyncio.run(main())["ts"]
