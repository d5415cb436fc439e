"""The `llm` backend: Kiln's LLM engine as a model in the repository.

Wire contract (KServe v2):
    inputs   text_input  BYTES [1]   the prompt (UTF-8)
             max_tokens  INT32 [1]   optional, default 64
             temperature FP32  [1]   optional, default 0 (greedy)
    outputs  text_output BYTES [1]

config.yaml `parameters` are engine options (`dtype`, `kv_cache_memory_gib`,
...) plus `model`: a path relative to the version directory, an absolute
path, or absent for the installed SmolLM2.

When `kiln serve` also serves this model on its OpenAI routes it registers
that engine here (`share_engine`) and both transports use one engine; a
repository served on its own gets an in-process engine of its own.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import InvalidRequestError, ModelLoadError
from kiln.serving.model import LoadContext, Model, Result
from kiln.serving.types import InferRequest

DEFAULT_MAX_TOKENS = 64
_SHARED: dict[str, tuple[Any, asyncio.AbstractEventLoop]] = {}


def share_engine(model_name: str, engine, loop: asyncio.AbstractEventLoop) -> None:
    """Let the repository model `model_name` run on an already-started AsyncLLM."""
    _SHARED[model_name] = (engine, loop)


def token_stream(request: InferRequest):
    """For ModelStreamInfer with parameter `stream: true` on an `llm` model
    that runs on a shared engine: an async iterator of InferResponses, one
    per new piece of text (`text_output` holds the delta), else None."""
    shared = _SHARED.get(request.model_name)
    if shared is None or not request.parameters.get("stream"):
        return None
    prompt, params = _parse(request)
    engine, _ = shared
    return _stream(engine, request, prompt, params)


async def _stream(engine, request: InferRequest, prompt: str, params):
    from kiln.serving.types import InferResponse

    request_id = f"kserve-stream-{request.model_name}-{id(request)}"
    async for out in engine.generate(prompt, params, request_id):
        if out.delta_text or out.finished:
            yield InferResponse(
                request.model_name, request.model_version or "1", _response(out.delta_text),
                id=request.id, parameters={"triton_final_response": out.finished},
            )


def engine_options(parameters: dict[str, Any], version_dir: Path) -> dict[str, Any]:
    """Engine options from config parameters, with `model` resolved safely."""
    options = dict(parameters)
    model = options.pop("model", None)
    if model is not None:
        path = Path(str(model))
        if not path.is_absolute():
            path = (version_dir / path).resolve()
            if version_dir.resolve() not in path.parents and path != version_dir.resolve():
                raise ModelLoadError(f"llm parameter model={model!r} leaves the version directory {version_dir}")
        options["model"] = str(path)
    return options


class LLMModel(Model):
    def load(self, context: LoadContext) -> None:
        self._name = context.config.name
        self._shared = _SHARED.get(self._name)
        self._counter = 0
        if self._shared is None:
            from kiln.llm.llm import LLM

            options = engine_options(context.config.parameters, context.version_dir)
            self._llm = LLM(options.pop("model", None), **options)

    def execute(self, requests: list[InferRequest]) -> list[Result]:
        parsed: list[tuple[str, Any] | BaseException] = []
        for request in requests:
            try:
                parsed.append(_parse(request))
            except InvalidRequestError as e:
                parsed.append(e)
        valid = [p for p in parsed if not isinstance(p, BaseException)]
        texts = iter(self._generate(valid) if valid else [])
        return [p if isinstance(p, BaseException) else _response(next(texts)) for p in parsed]

    def _generate(self, prompts: list[tuple[str, Any]]) -> list[str | BaseException]:
        if self._shared is None:
            try:
                outs = self._llm.generate([p for p, _ in prompts], [s for _, s in prompts])
            except InvalidRequestError as e:  # e.g. a prompt longer than the context
                return [e] * len(prompts)
            return [o.outputs[0].text for o in outs]
        engine, loop = self._shared
        futures = [asyncio.run_coroutine_threadsafe(self._one(engine, p, s), loop) for p, s in prompts]
        results: list[str | BaseException] = []
        for f in futures:
            try:
                results.append(f.result())
            except InvalidRequestError as e:
                results.append(e)
        return results

    async def _one(self, engine, prompt: str, params) -> str:
        self._counter += 1
        text = ""
        async for out in engine.generate(prompt, params, f"kserve-{self._name}-{self._counter}"):
            text = out.outputs[0].text
        return text

    def unload(self) -> None:
        self._llm = None


def _scalar(request: InferRequest, name: str, default):
    array = request.inputs.get(name)
    if array is None:
        return default
    if array.size != 1:
        raise InvalidRequestError(f"input {name!r} must hold exactly one element, got {array.size}")
    value = array.reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value  # BYTES arrays hold Python bytes


def _parse(request: InferRequest):
    from kiln.llm.sampling_params import SamplingParams

    text = _scalar(request, "text_input", None)
    if text is None:
        raise InvalidRequestError("missing input 'text_input'")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"text_input is not valid UTF-8: {e}") from None
    params = SamplingParams(
        max_tokens=int(_scalar(request, "max_tokens", DEFAULT_MAX_TOKENS)),
        temperature=float(_scalar(request, "temperature", 0.0)),
    )
    return str(text), params


def _response(result: str | BaseException) -> Result:
    if isinstance(result, BaseException):
        return result
    return {"text_output": np.array([result.encode("utf-8")], dtype=np.object_)}
