"""Every value of an OpenAI request is within what the engine can carry, and a
violation is a 400 naming the field (issue 17: values that once wedged or
killed the server)."""

from __future__ import annotations

import pytest

from kiln.errors import InvalidRequestError
from kiln.frontends.limits import MAX_JSON_DEPTH, parse_json
from kiln.frontends.openai.common import parse
from kiln.frontends.openai.limits import (
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
)
from kiln.frontends.openai.params import check_work, sampling_params
from kiln.frontends.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from kiln.frontends.openai.serving_embeddings import EmbeddingRequest

U64_PAST = 18446744073709551616  # 2**64: no 64-bit integer holds it
USER = [{"role": "user", "content": "hi"}]


def refused(model, body) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        parse(model, body)
    return e.value


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"seed": U64_PAST}, "seed"),
        ({"seed": 2**64 - 1}, "seed"),  # fits uint64, but choice 1 would use seed + 1
        ({"seed": -(2**63) - 1}, "seed"),
        ({"priority": U64_PAST}, "priority"),
        ({"priority": 2**31}, "priority"),
        ({"top_k": 9223372036854775808}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"stop_token_ids": [U64_PAST]}, "stop_token_ids.0"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"stop": ["\ud800"]}, "stop.0"),
        ({"stop": "\udfff"}, "stop"),
        ({"stop": ["ok"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * 10_000]}, "stop.0"),
        ({"stop": [""]}, "stop.0"),
        ({"logit_bias": {"\ud800": 1.0}}, "logit_bias.\\ud800"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"user": "\ud83d"}, "user"),
        ({"temperature": float("inf")}, "temperature"),
    ],
)
def test_completion_values_the_engine_cannot_carry_are_named(extra, param):
    e = refused(CompletionRequest, {"prompt": "x", **extra})
    assert e.param == param and e.http_status == 400, (e.param, e.message)
    assert param.split(".")[0] in e.message


@pytest.mark.parametrize(
    "prompt,param",
    [
        ("a\ud800b", "prompt"),
        (["fine", "\udc00"], "prompt.1"),
        ([2**31], "prompt.0"),
        ([[1, 2], [3, U64_PAST]], "prompt.1.1"),
        (["p"] * 5000, "prompt"),
    ],
)
def test_bad_prompts_are_named(prompt, param):
    assert refused(CompletionRequest, {"prompt": prompt}).param == param


def test_chat_and_tokenize_text_must_be_utf8():
    content = [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]
    assert refused(ChatCompletionRequest, {"messages": content}).param == "messages.0.content.0.text"
    assert refused(ChatCompletionRequest, {"messages": [{"role": "user", "content": "\ud800"}]}).param == (
        "messages.0.content"
    )
    assert refused(TokenizeRequest, {"prompt": "\udbff"}).param == "prompt"
    assert refused(ChatCompletionRequest, {"messages": USER, "seed": U64_PAST}).param == "seed"


def test_the_largest_seed_still_fits_every_choice():
    req = parse(CompletionRequest, {"prompt": "x", "seed": 2**63 - 1, "n": 16})
    seeds = [sampling_params(req, max_tokens=1, logprobs=None, choice=i).seed for i in range(16)]
    assert seeds[-1] == 2**63 - 1 + 15 < 2**64


def test_the_limits_leave_ordinary_requests_alone():
    body = {"prompt": ["a", "b"], "seed": -5, "top_k": -1, "priority": -3, "stop": ["\n", "ü🙂"],
            "stop_token_ids": [2], "logit_bias": {"11": -100.0}, "max_tokens": 5, "user": "ünïcode 🙂"}
    req = parse(CompletionRequest, body)
    assert req.seed == -5 and req.stop == ["\n", "ü🙂"]


@pytest.mark.parametrize(
    "raw,words",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nesting depth"),
        (b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1), "nesting depth"),
        (b'{"prompt": "\\ud800"}', "prompt: string is not valid UTF-8"),
        (b'{"prompt": "x", "stop": ["a\\udc00"]}', "stop.0: string is not valid UTF-8"),
        (b'{"prompt": "x", "temperature": NaN}', "temperature: number must be finite"),
        (b'{"prompt": "x", "temperature": 1e999}', "temperature: number must be finite"),
        (b'{"prompt": "x", ', "invalid JSON"),
        # "Integer value out of range" with no field: Python's int() stops at 4,300 digits.
        (b'{"prompt": "x", "seed": -' + b"9" * 5000 + b"}", "seed: an integer of 5000 digits is outside int64"),
    ],
)
def test_bodies_are_parsed_strictly_and_name_the_culprit(raw, words):
    with pytest.raises(InvalidRequestError) as e:
        parse_json(raw)
    assert words in e.value.message


def test_json_at_the_depth_limit_parses():
    depth = MAX_JSON_DEPTH
    assert parse_json(b'{"a":' * (depth - 1) + b"[1]" + b"}" * (depth - 1)) is not None


def test_prompts_times_n_is_capped():
    check_work(16, 16, 256)
    with pytest.raises(InvalidRequestError, match="max_prompts_per_request") as e:
        check_work(4000, 1, 256)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        check_work(1, 300, 256)
    assert e.value.param == "n"


BIG_SCHEMA = {"type": "object", "description": "x" * MAX_GRAMMAR_CHARS}
TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    "model,extra,param",
    [
        (CompletionRequest, {"guided_regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "guided_regex"),
        (CompletionRequest, {"guided_choice": ["a"] * (MAX_CHOICES + 1)}, "guided_choice"),
        (CompletionRequest, {"guided_json": BIG_SCHEMA}, "guided_json"),
        (CompletionRequest, {"structured_outputs": {"grammar": "g" * (MAX_GRAMMAR_CHARS + 1)}},
         "structured_outputs.grammar"),
        (ChatCompletionRequest, {"response_format": {"type": "json_schema", "json_schema": {"schema": BIG_SCHEMA}}},
         "response_format.json_schema.schema"),
        (ChatCompletionRequest, {"tools": [TOOL] * (MAX_TOOLS + 1)}, "tools"),
        (ChatCompletionRequest, {"tools": [{**TOOL, "function": {"name": "f", "parameters": BIG_SCHEMA}}]},
         "tools.0.function.parameters"),
        (CompletionRequest, {"best_of": 2**31}, "best_of"),
        (CompletionRequest, {"prompt_logprobs": U64_PAST}, "prompt_logprobs"),
        (EmbeddingRequest, {"dimensions": 2**31}, "dimensions"),
        (EmbeddingRequest, {"input": ["p"] * 5000}, "input"),
        (EmbeddingRequest, {"priority": 2**31}, "priority"),
    ],
)
def test_structured_tool_and_embedding_fields_are_capped(model, extra, param):
    base = {CompletionRequest: {"prompt": "x"}, ChatCompletionRequest: {"messages": USER},
            EmbeddingRequest: {"input": "x"}}[model]
    e = refused(model, {**base, **extra})
    assert e.param == param and e.http_status == 400, (e.param, e.message)


def test_an_assistant_message_carries_a_bounded_number_of_tool_calls():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*USER, {"role": "assistant", "tool_calls": [call] * (MAX_TOOL_CALLS + 1)}]
    assert refused(ChatCompletionRequest, {"messages": messages}).param == "messages.1.tool_calls"


def test_max_tokens_zero_scores_the_prompt():
    assert parse(CompletionRequest, {"prompt": "x", "max_tokens": 0, "echo": True}).max_tokens == 0


@pytest.mark.parametrize("prompt,limit", [
    ([1] * (MAX_PROMPT_TOKEN_IDS + 1), MAX_PROMPT_TOKEN_IDS),  # said "at most 4096 items", a string list's limit
    (["p"] * (MAX_PROMPT_TOKEN_IDS + 1), 4096),
    ([[1]] * 5000, 4096),
])
def test_an_over_long_prompt_list_names_the_limit_of_its_own_kind(prompt, limit):
    message = refused(CompletionRequest, {"prompt": prompt}).message
    assert f"at most {limit} items" in message, message
