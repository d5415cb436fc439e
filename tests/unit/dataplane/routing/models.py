"""A model repository for routing tests: model `m` with versions 1-3 (each
answers its version number; `fail_version` raises, a server-side error)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import yaml

from kiln.serving.types import InferRequest
from tests.unit.serving.models import write_model

VERSIONED_PY = textwrap.dedent('''
    import time
    import numpy as np

    class Versioned:
        def load(self, context):
            params = context.config.parameters
            self.version = context.version
            self.fail = int(params.get("fail_version", 0)) == context.version
            self.delay = float(params.get("delay_ms", 0)) / 1000

        def execute(self, requests):
            time.sleep(self.delay)
            if self.fail:
                raise RuntimeError(f"version {self.version} fails (injected)")
            return [{"OUT": np.full_like(r.inputs["IN"], self.version)} for r in requests]
''')


def versioned_config(**parameters) -> dict:
    return {
        "backend": "python",
        "max_batch_size": 8,
        "dynamic_batching": {"max_queue_delay_ms": 0},
        "version_policy": {"all": True},
        "inputs": [{"name": "IN", "datatype": "FP32", "dims": [-1]}],
        "outputs": [{"name": "OUT", "datatype": "FP32", "dims": [-1]}],
        "parameters": parameters,
    }


def versioned_repository(root: Path, routes: dict | None = None, versions=(1, 2, 3), **parameters) -> Path:
    write_model(root, "m", versioned_config(**parameters), {v: {"model.py": VERSIONED_PY} for v in versions})
    if routes is not None:
        (root / "routes.yaml").write_text(yaml.safe_dump({"routes": routes}))
    return root


def request(model: str = "r", version: str = "") -> InferRequest:
    return InferRequest(model, {"IN": np.ones((1, 2), np.float32)}, model_version=version)


def served_version(response) -> int:
    return int(response.outputs["OUT"].reshape(-1)[0])
