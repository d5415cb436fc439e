"""A step's token masks, applied to logit rows before any sampling.

Rows are found by (request id, output length): a plain row follows the
request's current output; row i of a speculative chunk follows the output
plus drafts d_1..d_i (verify.as_if_output builds exactly those requests), so
the same lookup serves the sampler, the verifier and every sampling mode.
"""
from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from kiln.llm.request import Request

RowKey = tuple[str, int]
_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, ceil(V/32)] int32 (bit j of word w allows token 32w + j) -> [R, V] bool."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


class StepMasks:
    """The masks of one step, filled on a worker thread (`future`)."""

    def __init__(self, future: Future[tuple[torch.Tensor, dict[RowKey, int]]]):
        self.future = future
        self.wait_s = 0.0  # time the step waited for the worker (0 when fully overlapped)

    def result(self) -> tuple[torch.Tensor, dict[RowKey, int]]:
        if not self.future.done():
            started = time.perf_counter()
            self.future.result()
            self.wait_s += time.perf_counter() - started
        return self.future.result()

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Set logits of tokens the grammar forbids to -inf, in place, for
        the rows of constrained requests."""
        bitmask, rows = self.result()
        pairs = [(i, rows[(r.request_id, r.num_output_tokens)]) for i, r in enumerate(requests)
                 if (r.request_id, r.num_output_tokens) in rows]
        if not pairs:
            return
        logit_rows = [i for i, _ in pairs]
        # Bitmask row k must sit at logits row k for the kernel; rows left at -1 allow every token.
        aligned = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        aligned[logit_rows] = bitmask[[j for _, j in pairs]]
        apply_bitmask(logits, aligned.to(logits.device), logit_rows)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[r] = -inf where bitmask[r] forbids, for r in rows, in place.

    xgrammar's kernel (C++ on CPU, CUDA/Triton on GPUs; fp32, bf16 and fp16
    logits) reads the packed bits directly: unpacking them into a [rows, vocab]
    bool tensor first cost about 4x more per step at batch 32."""
    import xgrammar  # the grammar backend: present whenever masks exist

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
