"""Kiln's LLM engine as a served model (the `llm` backend): one engine per
model version, reachable through KServe v2 and the OpenAI routes alike.

KServe v2 contract:
    inputs   text_input  BYTES [1]   the prompt (UTF-8)
             max_tokens  INT32 [1]   optional, default 64
             temperature FP32  [1]   optional, default 0 (greedy)
    outputs  text_output BYTES [1]
With max_batch_size > 0 each input has a batch dimension in front; every row
is its own engine request. Request parameter `stream: true` (gRPC
ModelStreamInfer) streams one response per new piece of text. Structured
outputs, as the OpenAI routes' vLLM names: one of the string parameters
`guided_json` (a JSON schema), `guided_regex`, `guided_grammar` (EBNF or
Lark), applied to every row.

Engine options come from the config's `parameters` (`dtype`,
`kv_cache_memory_gib`, ...) plus `model`: a relative path inside the version
directory (no absolute path, no `..`, and it must resolve, symlinks
included, inside it), or absent for the installed SmolLM2. A model given on
the command line (no version directory) names its model path freely.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Coroutine
from pathlib import Path
from typing import Any

import numpy as np

from kiln.config import EngineConfig
from kiln.dataplane.restarts import RestartPolicy
from kiln.dataplane.served_llm import ServedLLM
from kiln.errors import ConfigError, InvalidRequestError
from kiln.llm.engine.async_llm import AsyncLLM
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.structured.spec import MAX_GRAMMAR_CHARS, GrammarSpec, grammar_syntax
from kiln.llm.structured.validate import check_spec
from kiln.llm.tokenizer import is_inline_template
from kiln.metrics.server_metrics import LLMMetricFamilies, ServerMetrics
from kiln.serving.batching.batcher import request_priority
from kiln.serving.model import AsyncModel, LoadContext
from kiln.serving.parameters import flag_parameter, timeout_parameter_s
from kiln.serving.repository.config import TensorSpec
from kiln.serving.repository.embedding import split_embedding_settings
from kiln.serving.types import InferRequest, InferResponse

DEFAULT_MAX_TOKENS = 64
PATH_OPTIONS = ("model", "draft_model")  # engine options that name files: confined to the version directory
# (and chat_template where it names a file rather than holding the template)
INPUTS = (
    TensorSpec(name="text_input", datatype="BYTES", dims=(1,)),
    TensorSpec(name="max_tokens", datatype="INT32", dims=(1,), optional=True),
    TensorSpec(name="temperature", datatype="FP32", dims=(1,), optional=True),
)
OUTPUTS = (TensorSpec(name="text_output", datatype="BYTES", dims=(1,)),)


def engine_options(parameters: dict[str, Any], version_dir: Path | None) -> dict[str, Any]:
    """Engine options from config parameters, with `model` resolved inside the version directory.

    The messages name the parameter as written, never the host path it resolves to."""
    options = dict(parameters)
    if version_dir is not None:
        for name in PATH_OPTIONS:
            if options.get(name) is not None:
                options[name] = str(_inside_version(name, options[name], version_dir))
        template = options.get("chat_template")
        if template is not None and not is_inline_template(template):
            # A file, read into every prompt: one outside would hand any host file (a TLS key) to
            # whoever can load a config override and call /tokenize + /detokenize.
            options["chat_template"] = str(_inside_version("chat_template", template, version_dir))
    return options


def _inside_version(name: str, value: Any, version_dir: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"llm parameter '{name}' must be a relative path inside the version directory", param=name)
    path = Path(value)
    if path.is_absolute() or ".." in path.parts:
        raise ConfigError(f"llm parameter {name}={value!r} must be a relative path inside the version directory "
                          "(no absolute path, no '..')", param=name)
    root = version_dir.resolve()
    resolved = (root / path).resolve()
    if root not in resolved.parents:
        raise ConfigError(f"llm parameter {name}={value!r} leaves the version directory", param=name)
    return resolved


class LLMModel(AsyncModel):
    def __init__(
        self,
        families: LLMMetricFamilies,
        *,
        engine_mode: str = "process",
        max_queued_requests: int | None = None,
        drain_timeout_s: float = 30.0,
        restart_policy: RestartPolicy | None = None,
        max_rows: int | None = None,
        max_tokens_limit: int | None = None,
    ):
        self.families = families
        self.engine_mode = engine_mode
        self.max_queued_requests = max_queued_requests
        self.drain_timeout_s = drain_timeout_s
        self.restart_policy = restart_policy
        self.max_rows = max_rows  # prompts one request may carry (max_prompts_per_request)
        self.max_tokens_limit = max_tokens_limit  # the server's max_tokens_limit, as on the OpenAI routes
        self.served: ServedLLM | None = None

    async def load(self, context: LoadContext) -> None:
        name = context.config.name
        embedding, parameters = split_embedding_settings(dict(context.config.parameters))
        config = EngineConfig.from_flat(**engine_options(parameters, context.version_dir))
        served = ServedLLM(
            name,
            config,
            ServerMetrics(self.families, name),
            engine_mode=self.engine_mode,
            max_queued_requests=self.max_queued_requests,
            embedding=embedding,
            restart_policy=self.restart_policy,
        )
        self.served = served
        await served.load()

    def io_specs(self) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        return INPUTS, OUTPUTS

    def healthy(self) -> bool:
        return self.served is not None and self.served.state in ("ready", "draining")

    def health_problem(self) -> str:
        return "no engine" if self.served is None else f"engine {self.served.state}"

    async def unload(self) -> None:
        if self.served is not None:
            await self.served.drain_and_shutdown(self.drain_timeout_s)

    # ---- requests ------------------------------------------------------------
    async def infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        engine = self._engine()
        rows = self._rows(request)
        assert self.served is not None  # _engine() checked it
        priority = request_priority(request)
        self.served.admit(engine, len(rows))
        texts = await _all_or_none([_complete(engine, prompt, params, priority) for prompt, params in rows])
        shape = request.inputs["text_input"].shape
        return {"text_output": _bytes_array([t.encode("utf-8") for t in texts], shape)}

    def stream(self, request: InferRequest) -> AsyncGenerator[InferResponse, None] | None:
        if not flag_parameter(request.parameters, "stream"):
            return None
        rows = self._rows(request)
        if len(rows) != 1:
            raise InvalidRequestError(f"a streamed llm request takes one prompt, got {len(rows)}")
        engine = self._engine()
        priority = request_priority(request)
        assert self.served is not None
        self.served.admit(engine, 1)
        return self._stream(engine, request, *rows[0], priority)

    async def _stream(
        self, engine: AsyncLLM, request: InferRequest, prompt: str, params: SamplingParams, priority: int
    ) -> AsyncGenerator[InferResponse, None]:
        shape = request.inputs["text_input"].shape
        async for out in engine.generate(prompt, params, _request_id(), priority):
            if out.delta_text or out.finished:
                outputs = {"text_output": _bytes_array([out.delta_text.encode("utf-8")], shape)}
                yield InferResponse(request.model_name, request.model_version, outputs, id=request.id,
                                    parameters={"triton_final_response": out.finished})

    def _rows(self, request: InferRequest) -> list[tuple[str, SamplingParams]]:
        return _rows(request, self.max_rows, self.max_tokens_limit)

    def _engine(self) -> AsyncLLM:
        if self.served is None:
            raise InvalidRequestError("model is not loaded")
        return self.served.ready_engine()


async def _all_or_none(rows: list[Coroutine[Any, Any, str]]) -> list[str]:
    """Every row's text; a row that fails (a prompt too long) cancels the others,
    which would otherwise generate on for an answer nobody reads."""
    tasks = [asyncio.ensure_future(row) for row in rows]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _complete(engine: AsyncLLM, prompt: str, params: SamplingParams, priority: int) -> str:
    text = ""
    async for out in engine.generate(prompt, params, _request_id(), priority):
        text = out.outputs[0].text
    return text


def _request_id() -> str:
    return f"kserve-{uuid.uuid4().hex}"


def _rows(
    request: InferRequest, max_rows: int | None = None, max_tokens_limit: int | None = None
) -> list[tuple[str, SamplingParams]]:
    """(prompt, sampling params) of every row of the request."""
    prompts = request.inputs["text_input"].reshape(-1)
    if max_rows is not None and len(prompts) > max_rows:
        raise InvalidRequestError(
            f"text_input holds {len(prompts)} prompts; this server takes at most {max_rows} per request "
            "(max_prompts_per_request)", param="text_input")
    default = min(DEFAULT_MAX_TOKENS, max_tokens_limit) if max_tokens_limit else DEFAULT_MAX_TOKENS
    max_tokens = _column(request, "max_tokens", len(prompts), default)
    if not all(isinstance(m, int) for m in max_tokens):  # a float (or NaN) tensor: no silent truncation
        raise InvalidRequestError("max_tokens must be an integer tensor (INT32, INT64, ...)", param="max_tokens")
    if max_tokens_limit is not None and any(m > max_tokens_limit for m in max_tokens):
        raise InvalidRequestError(
            f"max_tokens exceeds this server's limit of {max_tokens_limit} (max_tokens_limit)", param="max_tokens")
    temperature = _column(request, "temperature", len(prompts), 0.0)
    _check_parameters(request.parameters)
    structured = _structured(request.parameters)
    salt = _cache_salt(request.parameters)
    return [
        (_text(p), SamplingParams(max_tokens=int(m), temperature=float(t), structured=structured, cache_salt=salt))
        for p, m, t in zip(prompts, max_tokens, temperature, strict=True)
    ]


# Sampling settings an OpenAI or vLLM client would send as request parameters: an
# llm model takes max_tokens and temperature as input tensors and no others, so
# any of these as a parameter is a 400 rather than silently unused.
SAMPLING_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "n",
                  "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                  "ignore_eos", "min_tokens", "logit_bias", "guided_choice", "response_format")


def _check_parameters(parameters: dict[str, Any]) -> None:
    unused = [name for name in SAMPLING_NAMES if name in parameters]
    if unused:
        raise InvalidRequestError(
            f"parameter {unused[0]!r} is not read by an llm model: max_tokens and temperature are its input "
            f"tensors, structured output is {', '.join(GUIDED)} (string parameters); the OpenAI API at "
            "/v1/completions takes every sampling setting", param=unused[0])
    timeout_parameter_s(parameters, 0.0)  # checked as on every KServe model; an llm request has no queue timeout


def _cache_salt(parameters: dict[str, Any]) -> str | None:
    """The `cache_salt` parameter, as on OpenAI requests: prefix-cache sharing only within one salt."""
    salt = parameters.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise InvalidRequestError("cache_salt must be a string parameter", param="cache_salt")
    return salt


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": ""}


def _structured(parameters: dict[str, Any]) -> GrammarSpec | None:
    """The request's one structured-output constraint (checked: a bad one is a 400 naming it)."""
    given = [name for name in GUIDED if name in parameters]
    if len(given) > 1:
        raise InvalidRequestError(f"set at most one of {', '.join(given)}", param=given[1])
    if not given:
        return None
    name, value = given[0], parameters[given[0]]
    if not isinstance(value, str):
        raise InvalidRequestError(f"parameter {name} must be a string", param=name)
    if len(value) > MAX_GRAMMAR_CHARS:  # as on the OpenAI routes
        raise InvalidRequestError(f"parameter {name} has {len(value)} characters; at most {MAX_GRAMMAR_CHARS}",
                                  param=name)
    spec = GrammarSpec(GUIDED[name] or grammar_syntax(value), value)
    check_spec(spec, name)
    return spec


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
