"""In-process engine: input processing, the core, output processing.

The offline `LLM` API and tests use this directly; the server runs the core
in its own process and keeps the same input/output processors.
"""
from __future__ import annotations

from kiln.config import EngineConfig
from kiln.llm.engine.builder import build_engine_core
from kiln.llm.engine.input_processor import InputProcessor, Prompt
from kiln.llm.engine.messages import EngineStats
from kiln.llm.engine.output_processor import OutputProcessor
from kiln.llm.models.checkpoint import Checkpoint
from kiln.llm.outputs import RequestOutput
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.tokenizer import load_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None):
        self.config = config
        # Only arch and paths are kept: the model holds its own weight copies.
        self.core, checkpoint = build_engine_core(config, checkpoint)
        self.arch = checkpoint.arch
        self.model_path = checkpoint.source
        self.tokenizer = load_tokenizer(checkpoint.tokenizer_path, config.model.chat_template)
        self.max_model_len = self.core.max_model_len
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len, self.arch.vocab_size, self.arch.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer)
        self.last_stats: EngineStats | None = None

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, pooling: str | None = None
    ) -> None:
        if request_id in self.outputs.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, msg = self.inputs.process(request_id, prompt, params, priority, pooling)
        self.outputs.add(request_id, text, msg.prompt_token_ids, params)
        self.core.add_request(msg)

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)
        for rid in request_ids:
            self.outputs.drop(rid)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def shutdown(self) -> None:
        """Stop parallel workers, if any (a single-process engine holds none)."""
        self.core.shutdown()

    def step(self) -> list[RequestOutput]:
        core_out = self.core.step()
        self.last_stats = core_out.stats
        results, to_abort = self.outputs.process(core_out.outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return results
