"""AsyncLLM: the asyncio face of an engine core in another process (or thread).

Composes the same pieces as `LLMEngine`: InputProcessor (validate, tokenize)
-> core client (EngineCoreRequest out, StepResult back) -> OutputProcessor
(incremental detokenization, stop strings). Everything here runs on one
event loop; the client's background thread only hands results over with
`call_soon_threadsafe`, so request state is never shared between threads.

    engine = await AsyncLLM.start(config, mode="process")
    async for out in engine.generate(prompt, params, request_id):
        print(out.delta_text)

Invariant: a request id is in `_streams` from `add_request` until its
finished output was queued, it was aborted, it failed in the engine, or the
engine died; exactly one of those ends it, and each ends the stream (an
abort silently, a failure with RequestFailedError, death with EngineDeadError).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kiln.config import EngineConfig
from kiln.errors import EngineDeadError, InvalidRequestError, KilnError, RequestFailedError
from kiln.llm.engine.core_client import EngineCoreClient, ProcessEngineClient, ThreadEngineClient
from kiln.llm.engine.input_processor import InputProcessor, Prompt
from kiln.llm.engine.messages import EngineCoreOutput, EngineStats, Ready, StepResult
from kiln.llm.engine.output_processor import OutputProcessor
from kiln.llm.generation_defaults import GenerationDefaults, load_generation_defaults
from kiln.llm.models.default_model import resolve_model_path
from kiln.llm.outputs import RequestOutput
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.tokenizer import Tokenizer, load_chat_template, load_tokenizer

log = logging.getLogger(__name__)

MODES = ("process", "thread")


@dataclass
class RequestTimes:
    """Timestamps (time.monotonic) of one request, for latency metrics."""

    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


class EngineObserver(Protocol):
    """Receives engine events (the metrics layer implements this)."""

    def on_step(self, stats: EngineStats | None, queue_times: Iterable[float]) -> None: ...
    def on_tokens(self, times: RequestTimes, num_new: int, now: float) -> None: ...
    def on_finished(self, times: RequestTimes, finish_reason: str) -> None: ...
    def on_failed(self, times: RequestTimes, reason: str) -> None: ...


class RequestStream:
    """The outputs of one request, in order. Iterate it once.

    Leaving the iteration early (break, cancellation, an exception in the
    consumer) aborts the request in the engine.
    """

    def __init__(self, request_id: str, on_abandon: Callable[[str], None]):
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._on_abandon = on_abandon

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def close(self) -> None:
        """Abort the request unless it finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._on_abandon(self.request_id)

    async def __aiter__(self) -> AsyncGenerator[RequestOutput, None]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.close()


class AsyncLLM:
    # Set by `start`, the only way to get an AsyncLLM that takes requests.
    info: Ready
    tokenizer: Tokenizer
    generation_defaults: GenerationDefaults
    inputs: InputProcessor
    outputs: OutputProcessor

    def __init__(self, client: EngineCoreClient, observer: EngineObserver | None = None):
        self.client = client
        self.observer = observer
        self.dead_message: str | None = None
        self.latest_stats: EngineStats | None = None
        self._streams: dict[str, RequestStream] = {}
        self._times: dict[str, RequestTimes] = {}
        self._pending: set[str] = set()  # added, no token yet
        self._dead = asyncio.Event()

    # ---- life cycle ----------------------------------------------------------
    @classmethod
    async def start(
        cls, config: EngineConfig, mode: str = "process", observer: EngineObserver | None = None
    ) -> AsyncLLM:
        if mode not in MODES:
            raise InvalidRequestError(f"engine mode must be one of {MODES}, got {mode!r}", param="engine_mode")
        client = ProcessEngineClient(config) if mode == "process" else ThreadEngineClient(config)
        engine = cls(client, observer)
        await engine._start()
        return engine

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()

        def on_result(result: StepResult) -> None:  # called on the client's thread
            loop.call_soon_threadsafe(self._on_result, result)

        def on_dead(message: str) -> None:
            loop.call_soon_threadsafe(self._on_dead, message)

        # Load the tokenizer while the engine loads its weights, if its path is obvious.
        guess = _tokenizer_path_guess(self.client.config)
        tok_task = loop.run_in_executor(None, load_tokenizer, guess) if guess else None
        info = await loop.run_in_executor(None, self.client.start, on_result, on_dead)
        tokenizer: Tokenizer | None = None
        if tok_task is not None and guess is not None:
            try:
                tokenizer = await tok_task
            except Exception:
                tokenizer = None
            if Path(info.tokenizer_path).resolve() != Path(guess).resolve():
                tokenizer = None  # the engine's model has its tokenizer elsewhere
        if tokenizer is None:
            tokenizer = await loop.run_in_executor(None, load_tokenizer, info.tokenizer_path)
        template = self.client.config.model.chat_template
        if template is not None:
            tokenizer = tokenizer.with_chat_template(load_chat_template(template))
        self.info, self.tokenizer = info, tokenizer
        self.generation_defaults = load_generation_defaults(info.tokenizer_path)
        self.inputs = InputProcessor(tokenizer, info.max_model_len, info.vocab_size, tuple(info.eos_token_ids))
        self.outputs = OutputProcessor(tokenizer)

    async def shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.client.shutdown)

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def is_dead(self) -> bool:
        return self.dead_message is not None

    async def wait_dead(self) -> str:
        """Returns (with the reason) once the engine has died."""
        await self._dead.wait()
        return self.dead_message or "unknown"

    @property
    def num_pending(self) -> int:
        """Requests added that have produced no token yet (queued or in prefill)."""
        return len(self._pending)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def oldest_pending_age(self) -> float:
        """Seconds the oldest request with no token yet has waited (0 when none)."""
        if not self._pending:
            return 0.0
        return time.monotonic() - min(self._times[rid].arrival for rid in self._pending)

    # ---- requests ------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, pooling: str | None = None
    ) -> RequestStream:
        """Validate and submit; errors (bad input, dead engine) raise here, before any output.
        With `pooling` ("last" | "mean") the request is an embedding: one output, its vector."""
        if self.dead_message is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead_message}")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        text, msg = self.inputs.process(request_id, prompt, params, priority, pooling)
        self.client.add_request(msg)  # first: it raises for a request the engine wire cannot carry
        stream = RequestStream(request_id, self.abort)
        self._streams[request_id] = stream
        self._times[request_id] = RequestTimes(time.monotonic(), len(msg.prompt_token_ids))
        self._pending.add(request_id)
        self.outputs.add(request_id, text, msg.prompt_token_ids, params)
        return stream

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        async for out in self.add_request(request_id, prompt, params, priority):
            yield out

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op if already finished); its blocks free at the next step."""
        if self._streams.pop(request_id, None) is None:
            return
        self._pending.discard(request_id)
        self.outputs.drop(request_id)
        self.client.abort([request_id])
        times = self._times.pop(request_id)
        if self.observer:
            self.observer.on_failed(times, "abort")

    # ---- engine events (on the event loop) -----------------------------------
    def _on_result(self, result: StepResult) -> None:
        if result.outputs.stats is not None:
            self.latest_stats = result.outputs.stats
        if self.observer:
            self.observer.on_step(result.outputs.stats, result.queue_times.values())
        engine_outputs = []
        for engine_out in result.outputs.outputs:
            if engine_out.error is not None:
                self._fail_in_engine(engine_out)
            else:
                engine_outputs.append(engine_out)
        try:
            outputs, to_abort = self.outputs.process(engine_outputs)
        except Exception as e:
            log.exception("output processing failed")
            self._fail([o.request_id for o in result.outputs.outputs], KilnError(f"output processing failed: {e}"))
            return
        self.client.abort(to_abort)  # finished here by a stop string
        now = time.monotonic()
        for out in outputs:
            self._deliver(out, now)

    def _fail(self, request_ids: list[str], error: KilnError) -> None:
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None:
                self.abort(rid)
                stream.put(error)

    def _fail_in_engine(self, engine_out: EngineCoreOutput) -> None:
        """The engine ended this request with an error (it is already gone there):
        a 400 when its own input was at fault, else RequestFailedError."""
        request_id = engine_out.request_id
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._pending.discard(request_id)
        self.outputs.drop(request_id)
        times = self._times.pop(request_id)
        if self.observer:
            self.observer.on_failed(times, "error")
        message = engine_out.error or ""
        if engine_out.invalid:
            stream.put(InvalidRequestError(message, param=engine_out.error_param))
        else:
            stream.put(RequestFailedError(f"the request failed in the engine: {message}"))

    def _deliver(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        self._pending.discard(out.request_id)
        times = self._times[out.request_id]
        if self.observer and out.delta_token_ids:
            self.observer.on_tokens(times, len(out.delta_token_ids), now)
        if times.first_token is None:
            times.first_token = now
        times.last_token = now
        times.num_generated += len(out.delta_token_ids)
        stream.put(out)
        if out.finished:
            del self._streams[out.request_id]
            del self._times[out.request_id]
            if self.observer:
                self.observer.on_finished(times, out.outputs[0].finish_reason or "stop")

    def _on_dead(self, message: str) -> None:
        self.dead_message = message
        self._dead.set()
        error = EngineDeadError(f"the engine died: {message}")
        for rid, stream in list(self._streams.items()):
            stream.put(error)
            if self.observer:
                self.observer.on_failed(self._times[rid], "engine_dead")
        self._streams.clear()
        self._times.clear()
        self._pending.clear()


def _tokenizer_path_guess(config: EngineConfig) -> str | None:
    """The tokenizer to load while the engine loads its weights, if obvious."""
    try:
        path = Path(resolve_model_path(config))
    except Exception:
        return None
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if path.is_dir() and ((path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()):
        return str(path)
    return None
