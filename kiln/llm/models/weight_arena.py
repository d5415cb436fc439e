"""A finished CPU model's weights moved into one allocation, in module order.

Loading leaves each weight in its own allocation; the small ones (a 135M
model's int4 projections are 0.1-0.9 MB each) come from the heap on 4 KiB
pages, scattered. A decode step streams every weight once, so each 4 KiB page
is a TLB miss (two-level walks in a VM) and each allocation a new stream for
the prefetchers. One allocation holds them all on huge pages (torch asks for
them above 2 MiB; kiln/__init__.py sets THP_MEM_ALLOC_ENABLE), laid out in
the order a step reads them. Batch-1 decode of the default model, Zen 4, 2
threads, 15 alternated process pairs: median 1.06x (0.88-1.24x: this box's
noise is as large; docs/benchmarks.md (One call per decode step; ...; the
weights in one allocation)); prefill and RSS unchanged.

Parameters keep their identity (`param.data` is rebound), so tied weights
stay tied; buffers are replaced in their module. A tensor that does not own
its whole storage (a view), is not a dense CPU tensor, was made under
inference mode (its `data` cannot be rebound to a normal tensor), or whose
storage another parameter or buffer shares stays where it is.
"""
from __future__ import annotations

import torch
from torch import nn

ALIGN = 64  # bytes: a cache line, and every dtype's alignment


def _owns_its_storage(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn and not t.is_quantized
        and not t.is_inference() and t.is_contiguous() and t.numel() > 0 and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _movable(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every parameter and buffer to move, each tensor once, in module order.
    Names only: holding the tensors here would keep every replaced buffer alive until the
    move ends (twice the weights' memory at the peak)."""
    found: list[tuple[nn.Module, str, int]] = []
    seen: set[int] = set()
    storages: dict[int, int] = {}
    for module in model.modules():
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            ptr = t.untyped_storage().data_ptr() if t.device.type == "cpu" and t.layout == torch.strided else 0
            storages[ptr] = storages.get(ptr, 0) + 1
            if _owns_its_storage(t):
                found.append((module, name, ptr))
    return [(m, n) for m, n, ptr in found if storages[ptr] == 1]


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    t: torch.Tensor | None = module._parameters[name] if name in module._parameters else module._buffers[name]
    if t is None:  # _movable names only tensors that are set
        raise KeyError(name)
    return t


def _padded(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def gather_weights(model: nn.Module) -> int:
    """Move `model`'s weights into one allocation (see the module docstring); returns
    the bytes moved. Call before anything keeps references to the tensors
    themselves (the fused decode layers): those would keep the old copies."""
    names = _movable(model)
    total = sum(_padded(_tensor(m, n).nbytes) for m, n in names)
    if total == 0:
        return 0
    arena = torch.empty(total, dtype=torch.uint8)
    offset = 0
    for module, name in names:
        t = _tensor(module, name)
        view = arena[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        offset += _padded(t.nbytes)
        if name in module._parameters:
            t.data = view  # the Parameter stays the same object; its old storage is freed here
        else:
            module._buffers[name] = view
        del t  # a replaced buffer is freed now, not at the end
    return total
