"""What the quantized Linear layers share: the dtype their kernels run in.

torch's CPU int8/int4 weight-only kernels are vectorized for bfloat16
activations; with float32 activations they take a slow path (measured on
an AVX2 box, batch 1: ~1-8 ms per SmolLM2 projection in float32 against
0.1-0.3 ms in bfloat16). So on CPU they always compute in bfloat16, and
a float32 model converts activations at the layer's edge. The CUDA int4
kernel takes bfloat16 only; CUDA int8 takes the model's dtype.

The scale buffers are stored in the kernel's dtype, and `model.to(dtype)`
must not recast them (that would cost a conversion per call), hence the
`_apply` override.
"""
from __future__ import annotations

import torch
from torch import nn


def kernel_dtype(device: torch.device, model_dtype: torch.dtype, bf16_only: bool) -> torch.dtype:
    if device.type == "cpu" or bf16_only:
        return torch.bfloat16
    return model_dtype


class QuantizedLinear(nn.Module):
    _kernel_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        dtypes = {name: getattr(self, name).dtype for name in self._kernel_buffers}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            setattr(self, name, getattr(self, name).to(dtype))  # device moves stay, dtype casts are undone
        return self
