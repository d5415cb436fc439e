"""CUDA graphs for decode steps.

A decode-only step (one new token per sequence, every row sampled, no
speculation) of n sequences replays the graph captured for the smallest
captured batch size B >= n. The graphs read persistent buffers: the step's
token ids, positions, KV slots, block tables and context lengths are copied
into rows [0, n); rows [n, B) are made inert (KV slot -1: nothing written;
context 0: attention gives 0) and their logits are ignored. Every other step
(prefill chunks, speculative verification, n > the largest size) runs
eagerly. Graphs need the Triton attention backend, whose per-step plan the
buffers stand in for.

Captured sizes are 1, 2, 4 and every multiple of 8 up to the maximum, so
every power of two up to it is one: the decode kernel's split count depends
on a batch only through its next power of two (triton_decode.max_splits_for),
and a padded graph batch splits each row's context exactly as the eager
batch would. The projections' GEMMs see B rows instead of n, so rows are
bit-identical to the eager step when n is a captured size and equal to the
GEMM's per-shape rounding otherwise.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from kiln.llm.attention.metadata import AttentionMetadata
from kiln.llm.kv_cache.manager import cdiv
from kiln.llm.runner.inputs import ModelInputs

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to and including max_batch."""
    sizes = {s for s in (1, 2, 4) if s <= max_batch} | set(range(8, max_batch + 1, 8)) | {max_batch}
    return sorted(sizes)


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n, or None if n is larger than all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def is_graph_step(inputs: ModelInputs) -> bool:
    """One token per sequence, each sampled, no prefill or speculation."""
    n = inputs.input_ids.numel()
    return (
        n > 0 and not inputs.meta.prefills and not inputs.has_spec
        and inputs.meta.num_decodes == n and len(inputs.sample_chunks) == n
    )


class DecodeBuffers:
    """The persistent inputs every captured decode graph reads (views of their first B rows)."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device):
        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)

        self.input_ids = zeros(max_batch)
        self.positions = zeros(max_batch)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.block_tables = zeros(max_batch, max_blocks_per_seq)
        self.context_lens = zeros(max_batch)

    def load(self, inputs: ModelInputs, batch: int) -> None:
        """Copy a decode step into rows [0, n) and make rows [n, batch) inert."""
        n = inputs.input_ids.numel()
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(inputs.meta.slot_mapping)
        for g in inputs.meta.decode_groups:
            rows = slice(g.first_row, g.first_row + g.num_seqs)
            self.block_tables[rows, : g.block_tables.shape[1]].copy_(g.block_tables)
            self.context_lens[rows].copy_(g.context_lens)
        self.make_inert(n, batch)

    def make_inert(self, first: int, end: int) -> None:
        self.input_ids[first:end].zero_()
        self.positions[first:end].zero_()
        self.slot_mapping[first:end].fill_(-1)
        self.context_lens[first:end].zero_()

    def metadata(self, batch: int, block_size: int, num_kv_heads: int) -> AttentionMetadata:
        """A decode step of `batch` rows over these buffers, with the Triton plan preset."""
        # Imported here: Triton is an optional dependency, needed only on CUDA.
        from kiln.llm.attention.triton_backend import TritonPlan, decode_plan

        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:batch], block_size=block_size, num_decodes=batch)
        plan = decode_plan(self.block_tables[:batch], self.context_lens[:batch], num_kv_heads)
        meta.kernel_plan = TritonPlan(batch, plan, None)
        return meta


class CudaGraphRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_model_len: int, max_batch: int,
                 device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = capture_sizes(max_batch)
        self.buffers = DecodeBuffers(self.sizes[-1], cdiv(max_model_len, block_size), device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def forward(self, batch: int) -> torch.Tensor:
        """Logits of every row of a `batch`-row decode step over the buffers."""
        b = self.buffers
        meta = b.metadata(batch, self.block_size, self.kv_caches[0].shape[2])
        hidden = self.model(b.input_ids[:batch], b.positions[:batch], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all in one memory pool. The buffers are inert while
        capturing, so neither warm-up nor capture writes the KV pool."""
        started = time.perf_counter()
        self.buffers.make_inert(0, self.sizes[-1])
        pool = None
        for batch in reversed(self.sizes):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compiles kernels, sets up cuBLAS
                self.forward(batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(batch)
            pool = graph.pool()
            self.graphs[batch] = (graph, logits)
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch 1..%d) in %.1fs", len(self.sizes), self.sizes[-1],
                 time.perf_counter() - started)

    def logits(self, inputs: ModelInputs) -> torch.Tensor | None:
        """The sampled rows' logits by graph replay, or None if the step is not a graph step."""
        if not is_graph_step(inputs):
            return None
        batch = padded_size(inputs.input_ids.numel(), self.sizes)
        if batch is None:
            return None
        self.buffers.load(inputs, batch)
        graph, logits = self.graphs[batch]
        graph.replay()
        return logits[inputs.sample_rows]


def build_cuda_graphs(runner, config, max_model_len: int) -> CudaGraphRunner | None:
    """Captured decode graphs for a single-process CUDA runner, or None where they do not apply."""
    if runner.device.type != "cuda" or not config.model.enable_cuda_graphs:
        return None
    # Imported here, after the device check: Triton is an optional dependency, needed only on CUDA.
    from kiln.llm.attention.backend import AttentionBackend
    from kiln.llm.attention.triton_backend import TritonPagedAttention

    backends = [m.backend for m in runner.model.modules() if isinstance(getattr(m, "backend", None), AttentionBackend)]
    if not backends or not all(isinstance(b, TritonPagedAttention) for b in backends):
        log.info("CUDA graphs off: they need the Triton attention backend")
        return None
    if runner.model.arch.moe is not None:
        log.info("CUDA graphs off: mixture-of-experts routing reads each expert's token count on the host")
        return None
    max_batch = min(config.model.cuda_graph_max_batch_size, config.scheduler.max_num_seqs)
    graphs = CudaGraphRunner(runner.model, runner.kv_caches, runner.block_size, max_model_len, max_batch,
                             runner.device)
    graphs.capture()
    return graphs
