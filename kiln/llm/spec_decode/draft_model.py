"""Draft-model proposer: a smaller model sharing the target's vocabulary,
with its own paged KV pool and block tables.

Per request the proposer keeps a shadow sequence whose first
`num_computed_tokens` tokens have draft KV. A proposal feeds the verified
tokens the draft has not seen yet (one chunk; the whole prompt the first
time), then its own drafts one at a time (k forwards in all, batched over
requests). Afterwards only verified tokens count as computed and blocks
past them are freed: draft KV never holds a token the target rejected.

Use `--spec-method draft --draft-model PATH` with a real small sibling
(e.g. a 135M model for a 1.7B target of the same family and tokenizer). Without
`--draft-model` the draft is the target's first `--draft-num-layers`
layers plus its final norm and LM head (weak, but needs no second model).
"""
from __future__ import annotations

import dataclasses

import torch

from kiln.llm.kv_cache.manager import KVCacheManager
from kiln.llm.models.arch import ModelArch
from kiln.llm.models.checkpoint import Checkpoint
from kiln.llm.models.llama import LlamaModel
from kiln.llm.models.registry import build_model
from kiln.llm.request import Request
from kiln.llm.runner.inputs import build_inputs
from kiln.llm.runner.kv_pool import kv_pool_tensor
from kiln.llm.sampling.sampler import Sampler, needs_processing, row_argmax
from kiln.llm.scheduler.output import ScheduledChunk
from kiln.llm.spec_decode.proposer import Proposer
from kiln.llm.spec_decode.verify import as_if_output


def truncated_model(checkpoint: Checkpoint, num_layers: int, max_positions: int) -> LlamaModel:
    """The checkpoint's first `num_layers` layers + final norm + LM head."""
    arch = truncated_arch(checkpoint.arch, num_layers)
    model = build_model(arch, max_positions)
    model.load_weights(checkpoint.weights, checkpoint.source, checkpoint.quantized)  # later layers: not read
    return model


def truncated_arch(arch: ModelArch, num_layers: int) -> ModelArch:
    """`arch` with its first `num_layers` layers (per-layer fields cut to match)."""
    n = min(num_layers, arch.num_layers)
    windows = arch.layer_windows[:n]
    moe = arch.moe and dataclasses.replace(arch.moe, dense_layers=tuple(i for i in arch.moe.dense_layers if i < n))
    return dataclasses.replace(arch, num_layers=n, layer_windows=windows if any(windows) else (), moe=moe)


def mirror(shadow: Request, request: Request) -> None:
    """The shadow holds the request's verified tokens, its prompt as the prompt
    and its outputs as outputs (drafts join the outputs): the runner attends a
    prompt's rows as a prefill and generated ones with the decodes."""
    shadow.prompt_token_ids = list(request.prompt_token_ids)
    shadow.output_token_ids = list(request.output_token_ids)


class DraftModelProposer(Proposer):
    def __init__(
        self, model: LlamaModel, num_blocks: int, block_size: int, device: torch.device, sampler: Sampler,
        kv_cache_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.sampler = sampler  # the target's: same logit processing and generators
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        a, dtype = model.arch, kv_cache_dtype or model.embed_tokens.dtype
        self.kv_caches = [
            kv_pool_tensor((2, num_blocks * block_size, a.num_kv_heads, a.head_dim), dtype, device)
            for _ in range(a.num_layers)
        ]
        self.shadows: dict[str, Request] = {}
        self._probs: dict[str, torch.Tensor] = {}

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        return self._probs.get(request_id)

    def retain(self, live_ids: set[str]) -> None:
        for rid in [rid for rid in self.shadows if rid not in live_ids]:
            self.kv.free(self.shadows.pop(rid))

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        self._probs.clear()
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, (r, k) in enumerate(zip(requests, num_drafts, strict=False)) if self._reserve(r, k)]
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        for step in range(max((num_drafts[i] for i in active), default=0)):
            active = [i for i in active if len(drafts[i]) < num_drafts[i]]
            chunks = [self._next_chunk(requests[i], step) for i in active]
            logits = self._forward(chunks)
            rows = [as_if_output(requests[i], drafts[i]) for i in active]
            for _j, (i, token, p) in enumerate(zip(active, *self._choose(logits, rows), strict=False)):
                drafts[i].append(token)
                self.shadows[requests[i].request_id].output_token_ids.append(token)
                if p is not None:
                    probs[i].append(p)
        for i in probs:
            r = requests[i]
            self._settle(r)
            if probs[i]:
                self._probs[r.request_id] = torch.stack(probs[i])
        return drafts

    # ---- helpers -------------------------------------------------------
    def _reserve(self, request: Request, k: int) -> bool:
        """Sync the shadow with the verified tokens; allocate draft KV for
        the unseen ones plus k - 1 drafts. False if the pool is too full."""
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, [], request.sampling_params)
            self.shadows[request.request_id] = shadow
        mirror(shadow, request)
        need = shadow.num_tokens - shadow.num_computed_tokens + k - 1
        if not self.kv.can_allocate(shadow, need):
            return False
        self.kv.allocate(shadow, need)
        return True

    def _next_chunk(self, request: Request, step: int) -> ScheduledChunk:
        shadow = self.shadows[request.request_id]
        start = shadow.num_computed_tokens if step == 0 else shadow.num_tokens - 1
        return ScheduledChunk(shadow, start, shadow.num_tokens - start, self.kv.block_ids(shadow.request_id))

    def _forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """One logits row per chunk, in the order of `chunks`. build_inputs orders its
        sampled rows its own way (decode-like chunks first, by context length): taken
        as they come, one request's draft went to another and acceptance collapsed."""
        inputs = build_inputs(chunks, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        row_of = {id(c): j for j, c in enumerate(inputs.sample_chunks)}
        order = [row_of[id(c)] for c in chunks]
        return self.model.compute_logits(hidden[inputs.sample_rows[order]])

    def _choose(self, logits: torch.Tensor, rows: list[Request]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Draft tokens (argmax for greedy requests, else a draw from the
        processed draft distribution q) and q for the non-greedy ones."""
        if any(needs_processing(r.sampling_params, r) or not r.sampling_params.greedy for r in rows):
            logits = self.sampler.process(logits.clone(), rows)
        tokens = row_argmax(logits).tolist()
        qs: list[torch.Tensor | None] = [None] * len(rows)
        random_rows = [j for j, r in enumerate(rows) if not r.sampling_params.greedy]
        if random_rows:
            warped = self.sampler.warp(logits[random_rows], [rows[j] for j in random_rows])
            for q, j in zip(warped, random_rows, strict=False):
                qs[j] = q
                tokens[j] = int(torch.multinomial(q, 1, generator=self.sampler.generator_for(rows[j])))
        return tokens, qs

    def _settle(self, request: Request) -> None:
        """Drafts leave the shadow: only verified tokens keep draft KV."""
        shadow = self.shadows[request.request_id]
        mirror(shadow, request)
        shadow.num_computed_tokens = shadow.num_tokens
        self.kv.rollback(shadow)
