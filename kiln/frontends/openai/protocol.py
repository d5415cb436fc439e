"""OpenAI request bodies, plus the vLLM extras users rely on.

Unknown fields are rejected (extra="forbid") and types are strict (no "1"
for 1, no 1 for true), so a typo or an unsupported feature is a 400 naming
the field, never a silently different answer. What any value may be (text,
int64, finite) and each field's representable range and size come from
limits.py; sampling ranges are checked once, by SamplingParams.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from kiln.frontends.openai.limits import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    CacheSalt,
    Int32,
    LogitBias,
    Logprobs,
    NonNegativeInt32,
    PositiveInt32,
    Prompt,
    Seed,
    Stop,
    StopTokenIds,
    TokenIds,
    TopK,
)
from kiln.frontends.openai.strict import Strict
from kiln.frontends.openai.structured import StructuredFields
from kiln.frontends.openai.tools.protocol import Tool, ToolCall, ToolFields


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(StructuredFields):
    """Fields shared by completions and chat (structured outputs: structured.py)."""

    model: str | None = None  # None: the server's (only) model
    n: PositiveInt32 = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None  # a route's sticky key (unless the x-kiln-route-key header gives one)
    # vLLM extras
    top_k: TopK | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: NonNegativeInt32 = 0
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds | None = None
    include_stop_str_in_output: bool = False
    priority: Int32 = 0
    # Kiln extra: false opts this request out of speculative decoding
    speculate: bool = True
    # vLLM extra: logprobs of every prompt token, with this many top alternatives
    prompt_logprobs: Int32 | None = None  # SamplingParams checks the range, naming the field
    # vLLM extra: only requests with the same salt share prefix-cache blocks (one salt per tenant)
    cache_salt: CacheSalt | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: NonNegativeInt32 | None = 16  # 0: score the prompt only (with echo or prompt_logprobs)
    logprobs: Logprobs | None = None
    echo: bool = False
    best_of: Int32 | None = None  # checked against n and max_n where those are known


class TextPart(Strict):
    type: Literal["text"]
    text: str


class MediaPart(Strict):
    """An image, audio, video or file part: parsed so it can be refused by name."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["image_url", "input_audio", "audio_url", "video_url", "file"]


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart | MediaPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # role tool: the call this result answers
    refusal: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: PositiveInt32 | None = None  # deprecated by OpenAI; max_completion_tokens wins
    max_completion_tokens: PositiveInt32 | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # as the chat prompt renders them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: TokenIds
