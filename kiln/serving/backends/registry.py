"""Backend name -> model class, imported lazily so that serving an ONNX
model never imports torch (and the reverse).

The `llm` backend is not here: it runs Kiln's LLM engine, which this package
does not import; the data plane passes it to the ModelManager as a factory."""
from __future__ import annotations

import importlib

from kiln.errors import ConfigError
from kiln.serving.model import Model

_BACKENDS = {
    "onnxruntime": "kiln.serving.backends.onnxruntime:OnnxRuntimeModel",
    "torch": "kiln.serving.backends.torch:TorchModel",
    "python": "kiln.serving.backends.python:PythonModel",
}

# Triton-style platform strings reported in model metadata.
PLATFORMS = {
    "onnxruntime": "onnxruntime_onnx",
    "torch": "pytorch_libtorch",
    "python": "python",
    "llm": "kiln_llm",
    "ensemble": "ensemble",
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def create_model(backend: str) -> Model:
    """A fresh, unloaded model object for `backend`."""
    target = _BACKENDS.get(backend)
    if backend == "llm":
        raise ConfigError("backend 'llm' runs on the server's LLM engine; serve it with `kiln serve`")
    if target is None:
        raise ConfigError(f"unknown backend {backend!r}; expected one of {backend_names()}")
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"backend {backend!r} is not available: {exc}") from None
    return getattr(module, class_name)()
