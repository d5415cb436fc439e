"""Small model repositories built in a test's tmp dir (shared by the unit
and integration tests of model serving)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import yaml


def write_model(repo: Path, name: str, config: dict, versions: dict[int, dict[str, bytes | str]] | None = None) -> Path:
    """Write `<repo>/<name>/config.yaml` and each version's files."""
    directory = Path(repo) / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for version, files in (versions or {}).items():
        vdir = directory / str(version)
        vdir.mkdir(exist_ok=True)
        for filename, content in files.items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(vdir / filename, mode) as f:
                f.write(content)
    return directory


def add_sub_onnx(datatype: str = "FP32", dims: int = 4, batched: bool = True) -> bytes:
    """ONNX model: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
    import onnx
    from onnx import TensorProto, helper

    elem = {"FP32": TensorProto.FLOAT, "INT32": TensorProto.INT32, "INT64": TensorProto.INT64}[datatype]
    shape = (["batch"] if batched else []) + [dims]
    inputs = [helper.make_tensor_value_info(n, elem, shape) for n in ("INPUT0", "INPUT1")]
    outputs = [helper.make_tensor_value_info(n, elem, shape) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [
        helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
    ]
    graph = helper.make_graph(nodes, "add_sub", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


# A python-backend model: OUT = IN * 2 after `delay_ms`; a request holding a
# negative value fails alone; `fail_load` makes load() raise.
DOUBLER_PY = textwrap.dedent('''
    import time
    import numpy as np
    from kiln.errors import InvalidRequestError

    class Doubler:
        def load(self, context):
            params = context.config.parameters
            if params.get("fail_load"):
                raise RuntimeError("asked to fail")
            self.delay = float(params.get("delay_ms", 0)) / 1000
            self.version = context.version

        def execute(self, requests):
            time.sleep(self.delay)
            results = []
            for r in requests:
                x = r.inputs["IN"]
                if (x < 0).any():
                    results.append(InvalidRequestError("negative input"))
                else:
                    results.append({"OUT": x * 2 + (self.version - 1) * 1000})
            return results
''')


def doubler_config(**overrides) -> dict:
    config = {
        "backend": "python",
        "max_batch_size": 8,
        "inputs": [{"name": "IN", "datatype": "FP32", "dims": [-1]}],
        "outputs": [{"name": "OUT", "datatype": "FP32", "dims": [-1]}],
    }
    config.update(overrides)
    return config


# A python-backend model for BYTES: TEXT -> UPPER (upper-cased) and LEN.
UPPER_PY = textwrap.dedent('''
    import numpy as np

    class Upper:
        def execute(self, requests):
            out = []
            for r in requests:
                text = r.inputs["TEXT"]
                upper = np.vectorize(lambda b: b.upper(), otypes=[object])(text)
                lengths = np.vectorize(len, otypes=[np.int32])(text)
                out.append({"UPPER": upper, "LEN": lengths})
            return out
''')


def upper_config() -> dict:
    return {
        "backend": "python",
        "max_batch_size": 0,
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "dims": [-1]}],
        "outputs": [{"name": "UPPER", "datatype": "BYTES", "dims": [-1]},
                    {"name": "LEN", "datatype": "INT32", "dims": [-1]}],
    }


def basic_repository(repo: Path) -> Path:
    """add_sub (ONNX, auto-config), doubler (python, batching), upper (BYTES)
    and an ensemble chaining add_sub -> doubler."""
    write_model(repo, "add_sub", {"backend": "onnxruntime", "max_batch_size": 8,
                                  "dynamic_batching": {"max_queue_delay_ms": 5}},
                {1: {"model.onnx": add_sub_onnx()}})
    write_model(repo, "doubler", doubler_config(dynamic_batching={"max_queue_delay_ms": 20}),
                {1: {"model.py": DOUBLER_PY}})
    write_model(repo, "upper", upper_config(), {1: {"model.py": UPPER_PY}})
    write_model(repo, "pipeline", {
        "backend": "ensemble",
        "max_batch_size": 8,
        "inputs": [{"name": "A", "datatype": "FP32", "dims": [4]}, {"name": "B", "datatype": "FP32", "dims": [4]}],
        "outputs": [{"name": "DOUBLED_SUM", "datatype": "FP32", "dims": [4]},
                    {"name": "DIFF", "datatype": "FP32", "dims": [4]}],
        "steps": [
            {"model": "add_sub", "input_map": {"INPUT0": "A", "INPUT1": "B"},
             "output_map": {"OUTPUT0": "sum", "OUTPUT1": "DIFF"}},
            {"model": "doubler", "input_map": {"IN": "sum"}, "output_map": {"OUT": "DOUBLED_SUM"}},
        ],
    })
    return repo
