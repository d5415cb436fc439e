"""Per-request sampling parameters, validated once on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.config import SEED_MAX, SEED_MIN
from kiln.errors import InvalidRequestError
from kiln.llm.structured.spec import GrammarSpec

# Upper bounds on what one request may ask for; the server may lower them.
MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 256
# What the engine can represent: seeds seed a torch.Generator (a 64-bit
# value, signed or not: SEED_MIN, SEED_MAX); counts and token ids are int32 on the device.
INT32_MAX = 2**31 - 1
# The lowest temperature above 0 that is sampled as given: logits / 1e-38 overflow
# to inf and the softmax to NaN (every token came out 0). Below it, this, as vLLM.
MIN_TEMPERATURE = 0.01


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Invariant after __post_init__: every field is within range, and
    `stop` / `stop_token_ids` are lists. Greedy when temperature == 0; a
    temperature in (0, MIN_TEMPERATURE) is raised to MIN_TEMPERATURE.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = sampled token only
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    speculate: bool = True  # False: never verify draft tokens for this request
    # The grammar the output must follow (structured outputs), if any.
    structured: GrammarSpec | None = None
    # Log-probabilities of every prompt token (and this many top alternatives
    # at each position); with max_tokens 0 the request only scores its prompt.
    prompt_logprobs: int | None = None
    # Prefix-cache isolation: only requests with the same salt share cached
    # blocks (vLLM's `cache_salt`); None shares with every unsalted request.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def _check_types(self) -> None:
        """Each field of its type, named when it is not (logprobs=2.5 was accepted, then failed
        the engine step; top_k="abc" raised a bare TypeError naming nothing)."""
        def bad(param: str, kind: str) -> None:
            value = getattr(self, param)
            raise InvalidRequestError(f"{param} must be {kind}, got {value!r}", param=param)

        for name in ("max_tokens", "min_tokens", "top_k") + tuple(
                n for n in ("logprobs", "prompt_logprobs", "seed") if getattr(self, n) is not None):
            if not _is_int(getattr(self, name)):
                bad(name, "an integer")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)):
                bad(name, "a number")
        for name in ("ignore_eos", "include_stop_str_in_output", "speculate"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true or false")
        if self.stop is not None and not isinstance(self.stop, str | list | tuple):
            bad("stop", "a string or a list of strings")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, list | tuple):
            bad("stop_token_ids", "a list of token ids")
        if not isinstance(self.logit_bias, dict) or not all(
                _is_int(k) and _is_number(v) for k, v in self.logit_bias.items()):
            bad("logit_bias", "a mapping of token ids to numbers")
        if self.structured is not None and not isinstance(self.structured, GrammarSpec):
            bad("structured", "a GrammarSpec (kiln.llm.structured.spec)")

    def _validate(self) -> None:
        def bad(param: str, why: str) -> None:
            raise InvalidRequestError(f"{param} {why}", param=param)

        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        scoring = self.prompt_logprobs is not None and self.max_tokens == 0
        if not isinstance(self.max_tokens, int) or (self.max_tokens < 1 and not scoring):
            bad("max_tokens", f"must be at least 1 (0 only to score a prompt, with prompt_logprobs), got "
                f"{self.max_tokens}")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str)
                                                and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            bad("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= INT32_MAX:
            bad("top_k", f"must be -1, 0 (disabled) or positive up to {INT32_MAX}, got {self.top_k}")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not all(is_text(s) for s in self.stop):
            bad("stop", "must be valid UTF-8 text")
        if any(not isinstance(t, int) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")
        if self.structured is not None and self.min_tokens > 0:
            bad("min_tokens", "cannot be combined with structured outputs (the grammar decides where output ends)")
        if self.structured is not None and self.ignore_eos:
            bad("ignore_eos", "cannot be combined with structured outputs (the grammar ends output with EOS)")
        for tok, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {tok}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_processing_always(self) -> bool:
        """Logits always need processing (bias or a grammar mask)."""
        return bool(self.logit_bias) or self.structured is not None

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_text(s: str) -> bool:
    """False for a string UTF-8 cannot carry (a lone surrogate)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
