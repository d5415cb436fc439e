"""ONNX Runtime backend: CPU provider, CUDA provider when asked and present.

A config without inputs/outputs gets them from the model graph (`io_specs`):
with max_batch_size > 0 the first (variable) dim is the batch dim.
"""
from __future__ import annotations

import numpy as np

from kiln.errors import ConfigError
from kiln.serving.backends.base import TensorModel
from kiln.serving.model import LoadContext
from kiln.serving.repository.config import TensorSpec
from kiln.serving.repository.loader import artifact_path

ORT_TYPES = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64", "tensor(int8)": "INT8",
    "tensor(int16)": "INT16", "tensor(int32)": "INT32", "tensor(int64)": "INT64",
    "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16", "tensor(string)": "BYTES",
}


def _providers(device: str) -> list[str]:
    import onnxruntime as ort

    if device == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ConfigError("device 'cuda' asked for, but onnxruntime has no CUDAExecutionProvider")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _threads(params: dict, name: str) -> int:
    """A thread-count parameter: an integer >= 0 (0: onnxruntime chooses)."""
    value = params.get(name, 0)
    text = str(value).strip()
    if isinstance(value, bool | float) or not (text.isascii() and text.isdigit()):
        raise ConfigError(f"parameters.{name} must be an integer >= 0, got {value!r}", param=name)
    return int(value)


class OnnxRuntimeModel(TensorModel):
    def load(self, context: LoadContext) -> None:
        import onnxruntime as ort

        super().load(context)
        path = artifact_path(context.version_dir, context.config.artifact or "model.onnx")
        params = context.config.parameters
        options = ort.SessionOptions()
        options.intra_op_num_threads = _threads(params, "intra_op_num_threads")
        options.inter_op_num_threads = _threads(params, "inter_op_num_threads")
        try:
            self.session = ort.InferenceSession(str(path), options, providers=_providers(context.config.device))
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ConfigError(f"onnxruntime could not load {path.name!r}: {exc}") from None
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.string_inputs = {i.name for i in self.session.get_inputs() if i.type == "tensor(string)"}

    def io_specs(self):
        batched = self.config.max_batch_size > 0
        inputs = tuple(self._spec(a, batched) for a in self.session.get_inputs())
        outputs = tuple(self._spec(a, batched) for a in self.session.get_outputs())
        return inputs, outputs

    def _spec(self, arg, batched: bool) -> TensorSpec:
        datatype = ORT_TYPES.get(arg.type)
        if datatype is None:
            raise ConfigError(f"ONNX tensor '{arg.name}' has unsupported type {arg.type}")
        dims = [d if isinstance(d, int) and d > 0 else -1 for d in arg.shape]
        if batched:
            if not dims or dims[0] != -1:
                raise ConfigError(
                    f"max_batch_size > 0 but ONNX tensor '{arg.name}' has no variable first dim {arg.shape}"
                )
            dims = dims[1:]
        return TensorSpec(name=arg.name, datatype=datatype, dims=tuple(dims))

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {k: (v.astype(str) if k in self.string_inputs else v) for k, v in inputs.items()}
        values = self.session.run(self.output_names, feed)
        return {name: _from_ort(v) for name, v in zip(self.output_names, values, strict=False)}

    def unload(self) -> None:
        self.session = None


def _from_ort(value) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind in "UO":
        out = np.empty(array.shape, dtype=object)
        for i, x in np.ndenumerate(array):
            out[i] = x.encode("utf-8") if isinstance(x, str) else bytes(x)
        return out
    return array
