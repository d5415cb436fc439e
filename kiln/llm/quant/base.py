"""What the quantized Linear layers share: the dtype torch's weight-only
kernels run in, and keeping their scale buffers in it.

Kiln's own CPU kernels (int8.py, int4_cpu.py) take float32 activations.
Where they do not apply, torch's kernels run: on CPU they are vectorized for
bfloat16 activations and slow with float32 ones (see docs/benchmarks.md
(Weight-only quantization)), so they compute in bfloat16 and a float32 model
converts activations at the layer's edge. The CUDA int4 kernel takes
bfloat16 only; CUDA int8 takes the model's dtype.

The scale buffers are stored in the kernel's dtype, and `model.to(dtype)`
must not touch them: a cast to the model's dtype and back would round them
(fp16 or fp32 scales through bfloat16 keep 8 bits of mantissa, so every
weight of a bf16 model would move off the stored grid) and a cast that stays
would cost a conversion per call. Hence the `_apply` override, which lets a
device move through and keeps the values as they were.
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
        kept = {name: getattr(self, name) for name in self._kernel_buffers}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            # The tensor from before `fn`, on the device `fn` chose: casting the result back instead
            # would not undo the rounding of a narrower dtype.
            setattr(self, name, before.to(getattr(self, name).device))
        return self
