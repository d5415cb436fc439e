"""Kiln's LLM engine as a served model (the `llm` backend): one engine per
model version, reachable through KServe v2 and the OpenAI routes alike.

KServe v2 contract:
    inputs   text_input  BYTES [1]   the prompt (UTF-8)
             max_tokens  INT32 [1]   optional, default 64
             temperature FP32  [1]   optional, default 0 (greedy)
    outputs  text_output BYTES [1]
With max_batch_size > 0 each input has a batch dimension in front; every row
is its own engine request. Request parameter `stream: true` (gRPC
ModelStreamInfer) streams one response per new piece of text.

Engine options come from the config's `parameters` (`dtype`,
`kv_cache_memory_gib`, ...) plus `model`: a path inside the version
directory, or absent for the installed SmolLM2. A model given on the command
line (no version directory) names its model path freely.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import numpy as np

from kiln.config import EngineConfig
from kiln.dataplane.served_llm import ServedLLM
from kiln.errors import ConfigError, InvalidRequestError
from kiln.llm.engine.async_llm import AsyncLLM
from kiln.llm.sampling_params import SamplingParams
from kiln.metrics.server_metrics import LLMMetricFamilies, ServerMetrics
from kiln.serving.model import AsyncModel, LoadContext
from kiln.serving.repository.config import TensorSpec
from kiln.serving.types import InferRequest, InferResponse

DEFAULT_MAX_TOKENS = 64
INPUTS = (
    TensorSpec(name="text_input", datatype="BYTES", dims=(1,)),
    TensorSpec(name="max_tokens", datatype="INT32", dims=(1,), optional=True),
    TensorSpec(name="temperature", datatype="FP32", dims=(1,), optional=True),
)
OUTPUTS = (TensorSpec(name="text_output", datatype="BYTES", dims=(1,)),)


def engine_options(parameters: dict[str, Any], version_dir: Path | None) -> dict[str, Any]:
    """Engine options from config parameters, with `model` resolved inside the version directory."""
    options = dict(parameters)
    model = options.pop("model", None)
    if model is not None and version_dir is not None:
        path = Path(str(model))
        if not path.is_absolute():
            root = version_dir.resolve()
            path = (root / path).resolve()
            if root not in path.parents and path != root:
                raise ConfigError(f"llm parameter model={model!r} leaves the version directory", param="model")
        model = str(path)
    if model is not None:
        options["model"] = str(model)
    return options


class LLMModel(AsyncModel):
    def __init__(
        self,
        families: LLMMetricFamilies,
        *,
        engine_mode: str = "process",
        max_queued_requests: int | None = None,
        drain_timeout_s: float = 30.0,
    ):
        self.families = families
        self.engine_mode = engine_mode
        self.max_queued_requests = max_queued_requests
        self.drain_timeout_s = drain_timeout_s
        self.served: ServedLLM | None = None

    async def load(self, context: LoadContext) -> None:
        name = context.config.name
        config = EngineConfig.from_flat(**engine_options(context.config.parameters, context.version_dir))
        served = ServedLLM(
            name,
            config,
            ServerMetrics(self.families, name),
            engine_mode=self.engine_mode,
            max_queued_requests=self.max_queued_requests,
        )
        self.served = served
        await served.load()

    def io_specs(self) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        return INPUTS, OUTPUTS

    def healthy(self) -> bool:
        return self.served is not None and self.served.state in ("ready", "draining")

    async def unload(self) -> None:
        if self.served is not None:
            await self.served.drain_and_shutdown(self.drain_timeout_s)

    # ---- requests ------------------------------------------------------------
    async def infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        engine = self._engine()
        rows = _rows(request)
        assert self.served is not None  # _engine() checked it
        self.served.admit(engine, len(rows))
        texts = await asyncio.gather(*(_complete(engine, prompt, params) for prompt, params in rows))
        shape = request.inputs["text_input"].shape
        return {"text_output": _bytes_array([t.encode("utf-8") for t in texts], shape)}

    def stream(self, request: InferRequest) -> AsyncGenerator[InferResponse, None] | None:
        if not request.parameters.get("stream"):
            return None
        rows = _rows(request)
        if len(rows) != 1:
            raise InvalidRequestError(f"a streamed llm request takes one prompt, got {len(rows)}")
        engine = self._engine()
        assert self.served is not None
        self.served.admit(engine, 1)
        return self._stream(engine, request, *rows[0])

    async def _stream(
        self, engine: AsyncLLM, request: InferRequest, prompt: str, params: SamplingParams
    ) -> AsyncGenerator[InferResponse, None]:
        shape = request.inputs["text_input"].shape
        async for out in engine.generate(prompt, params, _request_id()):
            if out.delta_text or out.finished:
                outputs = {"text_output": _bytes_array([out.delta_text.encode("utf-8")], shape)}
                yield InferResponse(request.model_name, request.model_version, outputs, id=request.id,
                                    parameters={"triton_final_response": out.finished})

    def _engine(self) -> AsyncLLM:
        if self.served is None:
            raise InvalidRequestError("model is not loaded")
        return self.served.ready_engine()


async def _complete(engine: AsyncLLM, prompt: str, params: SamplingParams) -> str:
    text = ""
    async for out in engine.generate(prompt, params, _request_id()):
        text = out.outputs[0].text
    return text


def _request_id() -> str:
    return f"kserve-{uuid.uuid4().hex}"


def _rows(request: InferRequest) -> list[tuple[str, SamplingParams]]:
    """(prompt, sampling params) of every row of the request."""
    prompts = request.inputs["text_input"].reshape(-1)
    max_tokens = _column(request, "max_tokens", len(prompts), DEFAULT_MAX_TOKENS)
    temperature = _column(request, "temperature", len(prompts), 0.0)
    return [
        (_text(p), SamplingParams(max_tokens=int(m), temperature=float(t)))
        for p, m, t in zip(prompts, max_tokens, temperature, strict=True)
    ]


def _column(request: InferRequest, name: str, rows: int, default: float) -> list[Any]:
    array = request.inputs.get(name)
    if array is None:
        return [default] * rows
    values = array.reshape(-1).tolist()
    if len(values) != rows:
        raise InvalidRequestError(f"input '{name}' has {len(values)} values for {rows} prompts", param=name)
    return values


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"text_input is not valid UTF-8: {e}", param="text_input") from None
    return str(value)


def _bytes_array(items: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(shape)
