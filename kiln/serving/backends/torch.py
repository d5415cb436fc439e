"""Torch backend: TorchScript (`model.pt`, torch.jit.load) or torch.export
archives (`model.pt2`, checked by torch_archive first). Never plain pickles.

Inputs are passed positionally in config order; a tensor, tuple/list or dict
result is mapped to the config outputs (dicts by name, sequences by order).
The config must list inputs and outputs (TorchScript has no typed signature).
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from kiln.errors import ConfigError
from kiln.serving.backends.base import TensorModel
from kiln.serving.backends.torch_archive import check_pt2_archive
from kiln.serving.model import LoadContext
from kiln.serving.repository.loader import artifact_path


class TorchModel(TensorModel):
    def load(self, context: LoadContext) -> None:
        import torch

        super().load(context)
        config = context.config
        if not config.has_io:
            raise ConfigError(f"torch model '{config.name}' must list its inputs and outputs in config.yaml")
        name = config.artifact or _default_artifact(context)
        path = artifact_path(context.version_dir, name)
        self.device = torch.device("cuda" if config.device == "cuda" else "cpu")
        self.module: Any = None  # a TorchScript module or an exported GraphModule
        try:
            if path.suffix == ".pt2":
                check_pt2_archive(path)
                self.module = torch.export.load(str(path)).module()
            else:
                with warnings.catch_warnings():  # TorchScript is deprecated, still supported
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self.module = torch.jit.load(str(path), map_location=self.device)
                self.module.eval()
        except ConfigError:
            raise
        except Exception as exc:  # torch raises many types for bad archives
            raise ConfigError(f"torch could not load {path.name!r}: {exc}") from None
        if path.suffix == ".pt2":
            self.module.to(self.device)
        self.input_names = [s.name for s in config.inputs]
        self.output_names = [s.name for s in config.outputs]

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        args = [_to_torch(inputs[name], self.device) if name in inputs else None for name in self.input_names]
        with torch.inference_mode():
            result = self.module(*args)
        return self._map_outputs(result)

    def _map_outputs(self, result) -> dict[str, np.ndarray]:
        import torch

        if isinstance(result, torch.Tensor):
            result = (result,)
        if isinstance(result, dict):
            missing = [n for n in self.output_names if n not in result]
            if missing:
                raise ValueError(f"model returned no output(s) {missing}")
            return {n: _to_numpy(result[n]) for n in self.output_names}
        if len(result) != len(self.output_names):
            raise ValueError(f"model returned {len(result)} outputs, config lists {len(self.output_names)}")
        return {n: _to_numpy(t) for n, t in zip(self.output_names, result, strict=False)}

    def unload(self) -> None:
        self.module = None


def _default_artifact(context: LoadContext) -> str:
    for candidate in ("model.pt", "model.pt2"):
        if context.version_dir is not None and (context.version_dir / candidate).exists():
            return candidate
    return "model.pt"


def _to_torch(array: np.ndarray, device):
    import torch

    if array.dtype == object:
        raise ValueError("the torch backend does not take BYTES tensors")
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _to_numpy(tensor) -> np.ndarray:
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()
