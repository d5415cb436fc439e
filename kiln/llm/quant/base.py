"""What the quantized Linear layers share: the dtype torch's weight-only
kernels run in, and keeping their scale buffers in it.

Kiln's own CPU kernels (int8.py, int4_cpu.py) take float32 activations.
Where they do not apply, torch's kernels run: on CPU they are vectorized for
bfloat16 activations and slow with float32 ones (see docs/benchmarks.md
(Weight-only quantization)), so they compute in bfloat16 and a float32 model
converts activations at the layer's edge. The CUDA int4 kernel takes
bfloat16 only; CUDA int8 takes the model's dtype.

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
