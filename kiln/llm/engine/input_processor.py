"""Validates a request and turns it into an EngineCoreRequest (API side)."""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import cast

from kiln.errors import InvalidRequestError, PromptTooLongError
from kiln.llm.engine.messages import EngineCoreRequest
from kiln.llm.sampling_params import SamplingParams, is_text
from kiln.llm.tokenizer import Tokenizer

# Text, token ids, or vLLM's dict forms of either: {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | list[int] | Mapping[str, str | list[int]]
PROMPT_KEYS = ("prompt", "prompt_token_ids")
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1
POOLINGS = ("last", "mean")


class InputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int, model_eos_ids: tuple[int, ...] = ()
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # The tokenizer's end-of-sequence token and the checkpoint's (generation_config.json, GGUF eot).
        self.eos_token_ids = tuple(dict.fromkeys((*tokenizer.eos_token_ids, *model_eos_ids)))

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            prompt = unwrap_prompt_dict(prompt)
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            if not is_text(prompt):
                raise InvalidRequestError("prompt is not valid UTF-8 text (it holds a lone surrogate)", param="prompt")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes | bytearray):
            raise InvalidRequestError(
                "a prompt is text, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'; "
                f"got {type(prompt).__name__}", param="prompt")
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        # True is an int to isinstance: [True, False, 504] was taken as [1, 0, 504].
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:3]}", param="prompt"
            )
        return None, cast(list[int], ids)  # every one checked an int above

    def process(
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, pooling: str | None = None
    ):
        if pooling is not None and pooling not in POOLINGS:
            raise InvalidRequestError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}", param="pooling")
        text, ids = self.tokenize(prompt)
        self.check_length(len(ids), params.max_tokens, prefill_only=pooling is not None or params.max_tokens == 0)
        bad_bias = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if bad_bias:
            raise InvalidRequestError(f"logit_bias token ids out of range: {bad_bias[:3]}", param="logit_bias")
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stops:
            raise InvalidRequestError(
                f"stop_token_ids must be in [0, {self.vocab_size}); got {bad_stops[:3]}", param="stop_token_ids"
            )
        if not isinstance(priority, int) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise InvalidRequestError(f"priority must be a 64-bit integer, got {priority}", param="priority")
        msg = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            arrival_time=time.monotonic(),
            pooling=pooling,
        )
        return text, msg

    def check_length(self, num_prompt_tokens: int, max_tokens: int, prefill_only: bool = False) -> None:
        """A prefill-only request (an embedding, a prompt scored with max_tokens 0)
        never holds a position for a token of its own: its prompt may fill the context."""
        if prefill_only:
            if num_prompt_tokens > self.max_model_len:
                raise PromptTooLongError(
                    f"prompt has {num_prompt_tokens} tokens; this model's maximum context length is "
                    f"{self.max_model_len} tokens", param="prompt")
            return
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {num_prompt_tokens} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, so the prompt must be shorter",
                param="prompt",
            )
        if num_prompt_tokens + max(max_tokens, 1) > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the maximum "
                f"context length of {self.max_model_len} tokens",
                param="max_tokens",
            )


def unwrap_prompt_dict(prompt: Mapping) -> str | list[int]:
    """vLLM's TextPrompt / TokensPrompt: exactly one of "prompt" (text) and "prompt_token_ids"."""
    unknown = sorted(str(key) for key in prompt if key not in PROMPT_KEYS)
    present = [key for key in PROMPT_KEYS if key in prompt]
    if unknown or len(present) != 1:
        problem = f"unsupported keys {unknown}" if unknown else f"{len(present)} of them"
        raise InvalidRequestError(f"a prompt dict holds one of 'prompt' or 'prompt_token_ids'; got {problem}",
                                  param="prompt")
    value = prompt[present[0]]
    if present[0] == "prompt" and not isinstance(value, str):
        raise InvalidRequestError(f"'prompt' must be text; got {type(value).__name__}", param="prompt")
    if present[0] == "prompt_token_ids" and isinstance(value, str | Mapping):
        raise InvalidRequestError(f"'prompt_token_ids' must be a list of token ids; got {type(value).__name__}",
                                  param="prompt")
    return value
