"""Owns the model, the KV pool tensors and the sampler; runs one step."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kiln.config import EngineConfig
from kiln.llm.models.llama import LlamaModel
from kiln.llm.request import Request
from kiln.llm.runner.inputs import ModelInputs, build_inputs
from kiln.llm.runner.kv_pool import kv_pool_tensor
from kiln.llm.runner.kv_warm import KvPoolWarmer
from kiln.llm.runner.prompt_outputs import Pooler, prompt_logprobs, wants_prompt_outputs
from kiln.llm.sampling.sampler import Sampler
from kiln.llm.scheduler.output import RunnerOutput, ScheduledChunk, SchedulerOutput
from kiln.llm.spec_decode.proposer import Proposer
from kiln.llm.spec_decode.verify import verify

if TYPE_CHECKING:
    from kiln.llm.runner.cuda_graphs import CudaGraphRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn}


def kv_dtype(config: EngineConfig) -> torch.dtype:
    """The KV pool's dtype: `cache.kv_cache_dtype` (resolve_dtype decides `auto`; undecided, the model's)."""
    name = config.cache.kv_cache_dtype
    return KV_DTYPES[config.model.dtype if name == "auto" else name]


def kv_bytes_per_block(model: LlamaModel, block_size: int, dtype: torch.dtype) -> int:
    a = model.arch
    return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    """The Runner of a model in this process."""

    def __init__(
        self, model: LlamaModel, num_blocks: int, block_size: int, device: torch.device, seed: int = 0,
        kv_cache_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.device = device
        self.block_size = block_size
        a = model.arch
        dtype = kv_cache_dtype or model.embed_tokens.dtype
        # One pool tensor per layer: [k|v, slot, kv_head, head_dim]; slot =
        # block_id * block_size + offset.
        self.kv_caches = [
            kv_pool_tensor((2, num_blocks * block_size, a.num_kv_heads, a.head_dim), dtype, device)
            for _ in range(a.num_layers)
        ]
        self.kv_warmer = KvPoolWarmer(self.kv_caches)
        self.sampler = Sampler(device, seed)
        self.proposer: Proposer | None = None  # set when speculative decoding is on
        self.cuda_graphs: CudaGraphRunner | None = None  # decode graphs, set by the builder on CUDA
        self.pooler = Pooler()
        self.activations_peak_bytes: int | None = None  # of the largest step, measured by the builder

    @property
    def supports_prompt_outputs(self) -> bool:
        """Embeddings and prompt logprobs (a parallel runner has neither)."""
        return True

    @property
    def worker_pids(self) -> list[int]:
        return []

    def check_health(self) -> None:
        """Nothing outside this process to lose (see ParallelRunner)."""

    def warm_kv_pool(self) -> bool:
        return self.kv_warmer.step()

    def shutdown(self) -> None:
        pass

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        inputs = build_inputs(sched.chunks, self.block_size, self.device)
        if any(wants_prompt_outputs(c.request) for c in sched.chunks):
            return self._execute_with_prompt_outputs(inputs)
        logits = self.cuda_graphs.logits(inputs) if self.cuda_graphs is not None else None
        if logits is None:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            if not inputs.sample_chunks:
                return RunnerOutput()
            logits = self.model.head_logits(hidden if inputs.samples_every_row else hidden[inputs.sample_rows])
        return self._sample(logits, inputs.sample_chunks, inputs.has_spec)

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk], has_spec: bool) -> RunnerOutput:
        # logits: the head's dtype (LlamaModel.head_logits); the sampler widens what it processes.
        if has_spec:
            return self._sample_spec(logits, chunks)
        requests = [c.request for c in chunks]
        tokens = self.sampler(logits, requests)
        return RunnerOutput({r.request_id: t for r, t in zip(requests, tokens, strict=False)})

    def _execute_with_prompt_outputs(self, inputs: ModelInputs[ScheduledChunk]) -> RunnerOutput:
        """An eager step where some chunks want every position: prompt logprobs,
        embeddings (prefill-only chunks never sample)."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        out = RunnerOutput()
        for c, first in inputs.chunk_rows:
            request = c.request
            chunk_hidden = hidden[first : first + c.num_tokens]
            if request.sampling_params.prompt_logprobs is not None and c.start < request.num_prompt_tokens:
                entries = prompt_logprobs(self.model.compute_logits, chunk_hidden, request, c.start, c.num_tokens)
                if entries:
                    out.prompt_logprobs[request.request_id] = entries
            if request.pooling is not None:
                vector = self.pooler.add(request, chunk_hidden, c.start, c.sample)
                if vector is not None:
                    out.embeddings[request.request_id] = vector
        rows: list[int] = []
        chunks: list[ScheduledChunk] = []
        at = 0
        for c in inputs.sample_chunks:
            if not c.request.prefill_only:
                rows += inputs.sample_rows[at : at + c.num_logit_rows].tolist()
                chunks.append(c)
            at += c.num_logit_rows
        if chunks:
            sampled = self._sample(self.model.head_logits(hidden[rows]), chunks, inputs.has_spec)
            out.sampled, out.spec_sampled = sampled.sampled, sampled.spec_sampled
        return out

    def _sample_spec(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> RunnerOutput:
        """Plain rows go through the sampler as usual; speculative chunks'
        1 + k rows each are verified against their drafts."""
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        row = 0
        for c in chunks:
            (spec_rows if c.draft_token_ids else plain_rows).extend(range(row, row + c.num_logit_rows))
            row += c.num_logit_rows
        out = RunnerOutput()
        plain = [c.request for c in chunks if not c.draft_token_ids]
        if plain:
            tokens = self.sampler(logits[plain_rows], plain)
            out.sampled = {r.request_id: t for r, t in zip(plain, tokens, strict=False)}
        spec = [c for c in chunks if c.draft_token_ids]
        out.spec_sampled = verify(logits[spec_rows], spec, self.sampler, self.proposer)
        return out

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        if self.proposer is None:
            return [[] for _ in requests]
        return self.proposer.propose(requests, num_drafts)

    @torch.inference_mode()
    def logits_for(self, sched: SchedulerOutput) -> torch.Tensor:
        """Test hook: run a step and return logits for every fed token."""
        inputs = build_inputs(sched.chunks, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return self.model.compute_logits(hidden)
