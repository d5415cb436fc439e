"""Offline batch generation: `LLM(model).generate(prompts, params)`."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kiln.config import EngineConfig
from kiln.errors import EngineDeadError
from kiln.llm.engine.input_processor import Prompt
from kiln.llm.engine.llm_engine import LLMEngine
from kiln.llm.models.checkpoint import Checkpoint
from kiln.llm.outputs import RequestOutput
from kiln.llm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LLM:
    """Loads a model (default: the installed SmolLM2 GGUF) and generates.

    Options are the flat names of EngineConfig fields (dtype, device,
    block_size, kv_cache_memory_gib, max_num_batched_tokens, ...), with
    EngineConfig's defaults.
    With warm_kv_pool (the default) a CPU KV pool is faulted in before the
    constructor returns (`_fault_in_kv_pool`).
    """

    def __init__(
        self, model: str | os.PathLike[str] | None = None, checkpoint: Checkpoint | None = None, **options: Any
    ):
        """`model`: a checkpoint path, str or os.PathLike, as every path option
        (`draft_model=Path(...)`) may be (None: `checkpoint`'s
        source, else the installed SmolLM2). `checkpoint`: `model` already
        loaded (`load_checkpoint`), so several engines share one read of the files."""
        if model is None and checkpoint is not None:
            model = checkpoint.source
        self.config = EngineConfig.from_flat(model=model, **options)
        self.engine = LLMEngine(self.config, checkpoint)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0
        self._shut_down = False
        if self.config.cache.warm_kv_pool:
            self._fault_in_kv_pool()

    def _fault_in_kv_pool(self) -> None:
        """A server faults its pool in while idle (engine/loop.py); an offline
        batch has no idle time, so its first writes would take the faults inside
        steps, where a fault stalls every thread of the step. On a VM that backs
        guest memory on first use that cost the 64-request SmolLM2 run ~10 s of
        77 (docs/benchmarks.md, "The KV pool faulted in when the offline LLM is
        built"). vLLM's LLM likewise zeroes its whole KV cache when built."""
        def fault_in(_: int) -> int:
            pieces = 0
            while self.engine.core.warm_kv_pool():
                pieces += 1
            return pieces

        started = time.perf_counter()
        # One thread per core: where the host backs memory on first use its
        # faults are served in parallel (two threads 2.2x one on a 2-vCPU VM).
        threads = max(1, torch.get_num_threads())
        with ThreadPoolExecutor(threads) as pool:
            pieces = sum(pool.map(fault_in, range(threads)))
        if pieces:
            log.info("KV pool faulted in: %d pieces in %.1f s (--no-warm-kv-pool leaves it to first writes)",
                     pieces, time.perf_counter() - started)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        ids = self._submit([(prompt, p, None) for prompt, p in zip(prompts, params, strict=False)])
        finished: dict[str, RequestOutput] = {}
        with self._aborted_on_error(ids):
            while self.engine.has_unfinished() or len(finished) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                if not self.engine.has_unfinished() and len(finished) < len(ids):
                    break
        return [finished[rid] for rid in ids]

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str = "last") -> list[list[float]]:
        """Pooled final hidden state of each prompt ("last" token or "mean"), not normalised."""
        prompts = _as_prompt_list(prompts)
        ids = self._submit([(prompt, SamplingParams(max_tokens=1), pooling) for prompt in prompts])
        vectors: dict[str, list[float]] = {}
        with self._aborted_on_error(ids):
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.embedding is not None:
                        vectors[out.request_id] = out.embedding
        return [vectors[rid] for rid in ids]

    def _submit(self, requests: list[tuple[Prompt, SamplingParams, str | None]]) -> list[str]:
        """Add every request or none: one refused aborts those added before it, which
        would otherwise run in the next call (holding KV blocks meanwhile)."""
        if self._shut_down:  # a parallel engine's workers are gone: "a collective failed" said nothing useful
            raise EngineDeadError("this LLM was shut down (its `with` block ended or shutdown() was called); "
                                  "create a new LLM to generate again")
        ids: list[str] = []
        with self._aborted_on_error(ids):
            for prompt, params, pooling in requests:
                rid = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, prompt, params, pooling=pooling)
                ids.append(rid)
        return ids

    @contextlib.contextmanager
    def _aborted_on_error(self, ids: list[str]) -> Iterator[None]:
        """An error (or Ctrl-C) while these requests run leaves none of them queued."""
        try:
            yield
        except BaseException:
            self.engine.abort(ids)
            raise

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor/pipeline-parallel engine; later requests are refused."""
        if not self._shut_down:
            self._shut_down = True
            self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([ids], sampling_params)[0]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):  # one prompt (a dict is one prompt, not its keys)
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
