"""OpenAI request fields -> SamplingParams (which checks the ranges)."""

from __future__ import annotations

from typing import Any

from kiln.errors import InvalidRequestError
from kiln.frontends.openai.protocol import SamplingFields
from kiln.llm.generation_defaults import GenerationDefaults
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.structured.spec import GrammarSpec

NO_DEFAULTS = GenerationDefaults()


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, limit: int | None) -> int:
    """The output budget: as asked (within the server limit), else all the context left."""
    if requested is None:
        room = max(1, max_model_len - prompt_len)  # <1 left: the length check names the prompt
        return min(room, limit) if limit else room
    if limit is not None and requested > limit:
        raise InvalidRequestError(
            f"max_tokens ({requested}) exceeds this server's limit of {limit} (max_tokens_limit)", param="max_tokens"
        )
    return requested


def check_n(n: int, max_n: int) -> None:
    if n < 1:
        raise InvalidRequestError(f"n must be at least 1, got {n}", param="n")
    if n > max_n:
        raise InvalidRequestError(f"n ({n}) exceeds this server's limit of {max_n} (max_n)", param="n")


def check_work(num_prompts: int, n: int, limit: int) -> None:
    """One request runs num_prompts x n engine requests; at most `limit` (max_prompts_per_request)."""
    if num_prompts * n > limit:
        raise InvalidRequestError(
            f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} generations; this server takes at most "
            f"{limit} per request (max_prompts_per_request)",
            param="prompt" if num_prompts > 1 else "n",
        )


def parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        # Plain ASCII digits only: int() also reads "5_0", " +50 " and other scripts' digits.
        if not (key.isascii() and key.isdigit()):
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def sampling_params(
    req: SamplingFields, *, max_tokens: int, logprobs: int | None, choice: int,
    defaults: GenerationDefaults = NO_DEFAULTS, structured: GrammarSpec | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Choice `i` of a seeded request uses seed + i, so n > 1 gives n different
    samples and the same request gives the same n samples again. Fields the
    request leaves unset take the model's generation_config defaults, then the API's."""
    if req.stream_options is not None and not req.stream:  # as vLLM: options of a stream that is not one
        raise InvalidRequestError("stream_options is only allowed with stream: true", param="stream_options")
    d = defaults
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=_first(req.temperature, d.temperature, 1.0),
        top_p=_first(req.top_p, d.top_p, 1.0),
        top_k=_first(req.top_k, d.top_k, 0),
        min_p=_first(req.min_p, d.min_p, 0.0),
        repetition_penalty=_first(req.repetition_penalty, d.repetition_penalty, 1.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=None if req.seed is None else req.seed + choice,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        logit_bias=parse_logit_bias(req.logit_bias),
        include_stop_str_in_output=req.include_stop_str_in_output,
        speculate=req.speculate,
        structured=structured,
        prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        cache_salt=req.cache_salt,
    )
