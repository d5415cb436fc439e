"""The memory a step's activations take at their peak, measured once at start-up.

The largest step the scheduler can make is `max_num_batched_tokens` tokens
of prefill whose last rows (at most `max_num_seqs`, one per sequence) are
turned into logits. One such forward pass runs over a scratch KV pool of
just its own tokens (the engine's pool stays untouched: its pages are
zeroed lazily and would count as activations), and its peak is read from
the process's high-water mark: on CPU the kernel's VmHWM after resetting it
(`/proc/self/clear_refs`, value 5) with the scratch pool already resident
and the heap's free pages handed back first (memory glibc keeps from earlier
frees, e.g. the model build's, would be reused without raising the RSS);
on CUDA torch's peak allocated bytes. What the first step of every shape
pays once (oneDNN primitives, allocator pools) is counted too: it stays.
A step that asks for prompt logprobs computes logits for every prompt token
and can exceed this figure; so can a step with speculative rows.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

from kiln.llm.attention.metadata import AttentionMetadata, PrefillSeq
from kiln.llm.engine.heap import trim_heap

log = logging.getLogger(__name__)

STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def status_bytes(field: str, status: Path = STATUS) -> int | None:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes, or None."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class PeakMeter(Protocol):
    def start(self) -> bool:
        """Take the baseline and reset the peak; False if this meter cannot measure here."""

    def peak(self) -> int:
        """Bytes above the baseline at the peak since start()."""


class HostPeak:
    """The process's resident set: VmHWM, reset to VmRSS through clear_refs."""

    def __init__(self, status: Path = STATUS, clear_refs: Path = CLEAR_REFS):
        self.status, self.clear_refs, self.baseline = status, clear_refs, 0

    def start(self) -> bool:
        trim_heap()
        rss = status_bytes("VmRSS", self.status)
        try:
            self.clear_refs.write_text("5")
        except OSError:
            return False
        self.baseline = rss or 0
        return rss is not None

    def peak(self) -> int:
        return max(0, (status_bytes("VmHWM", self.status) or 0) - self.baseline)


class CudaPeak:
    """torch's allocated bytes on one CUDA device."""

    def __init__(self, device: torch.device):
        self.device, self.baseline = device, 0

    def start(self) -> bool:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.baseline = torch.cuda.memory_allocated(self.device)
        return True

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.baseline)


@torch.inference_mode()
def measure_activation_peak(
    model, tokens: int, sampled_rows: int, block_size: int, device: torch.device, meter: PeakMeter | None = None,
) -> int | None:
    """Peak bytes of one prefill forward of `tokens` tokens and the logits of its last
    `sampled_rows` rows, over a scratch KV pool made resident before the baseline; None
    where the peak cannot be read (no /proc, clear_refs refused)."""
    meter = meter or (CudaPeak(device) if device.type == "cuda" else HostPeak())
    a = model.arch
    slots = -(-tokens // block_size) * block_size
    scratch = [torch.zeros(2, slots, a.num_kv_heads, a.head_dim, dtype=model.embed_tokens.dtype, device=device)
               .fill_(0) for _ in range(a.num_layers)]
    ids = torch.randint(0, a.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(tokens, device=device)
    meta = AttentionMetadata(slot_mapping=positions.clone(), block_size=block_size,
                             prefills=[PrefillSeq(0, tokens, tokens, None)])
    if not meter.start():
        log.info("activation peak not measured: the process's peak memory cannot be reset here")
        return None
    hidden = model(ids, positions, scratch, meta)
    model.compute_logits(hidden[tokens - min(sampled_rows, tokens):])
    del hidden
    return meter.peak()
