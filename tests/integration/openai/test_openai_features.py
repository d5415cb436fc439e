"""The stock `openai` client against a live server on the real SmolLM2:
structured outputs (`chat.completions.parse` with a pydantic model, a streamed
json_schema), tool calling (the client's pydantic tool helper, a streamed
named call, a tool result in the conversation), embeddings, echo with logprobs."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.openai.live import kiln_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=20)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


VERDICT = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    flags = ["--kv-cache-memory-gib", "0.25", "--served-model-name", MODEL]
    with kiln_server(smollm2_path, *flags, tmp_dir=tmp_path_factory.mktemp("features")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(
        model=MODEL, messages=ask("Name a big city and its country, as JSON."), response_format=City,
        max_tokens=60, temperature=0,
    )
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City) and message.parsed.name


def test_streamed_json_schema_validates(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ask("Is the sea salty? Answer as JSON."), max_tokens=40, temperature=0.8, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}},
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), VERDICT)


def test_required_tool_call_parses_with_the_client_helper(client):
    out = client.chat.completions.parse(
        model=MODEL, messages=ask("What is the weather in Paris?"), tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", max_tokens=100, temperature=0,  # room for pretty-printed arguments
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.id and call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_named_tool_call_streams_name_then_argument_deltas(client):
    tool = openai.pydantic_function_tool(GetWeather)
    stream = client.chat.completions.create(
        model=MODEL, messages=ask("Weather in Rome in fahrenheit?"), tools=[tool],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, max_tokens=60, temperature=0,
        stream=True,
    )
    deltas = [c.choices[0].delta.tool_calls[0] for c in stream if c.choices and c.choices[0].delta.tool_calls]
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.function.name == "GetWeather" and first.index == 0
    assert rest and all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    GetWeather.model_validate_json(arguments)


def test_tool_result_in_the_conversation(client, server):
    call = {"id": "call_1", "type": "function", "function": {"name": "GetWeather",
                                                               "arguments": '{"city": "Oslo", "unit": "celsius"}'}}
    messages = [*ask("Weather in Oslo?"), {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "It is 21 degrees and sunny."}]
    tools = [openai.pydantic_function_tool(GetWeather)]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=8, temperature=0)
    assert out.choices[0].message.content
    without_result = server.post("/tokenize", json={"messages": messages[:2]}).json()["count"]
    assert out.usage.prompt_tokens > without_result  # the tool result is in the prompt
    # /tokenize renders the tools as the chat prompt does (vLLM's field; it was a 400 "unknown field")
    assert server.post("/tokenize", json={"messages": messages, "tools": tools}).json()["count"] == (
        out.usage.prompt_tokens)
    refused = server.post("/tokenize", json={"prompt": "hi", "tools": tools})
    assert refused.status_code == 400 and "tools go with messages" in refused.text


def test_embeddings_float_and_base64_agree(client):
    texts = ["The cat sat on the mat.", "Stocks fell sharply today."]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    packed = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes
    a = np.array([d.embedding for d in floats.data])
    b = np.array([d.embedding for d in packed.data])
    assert a.shape == (2, 576) and np.allclose(a, b, atol=1e-6)
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    assert floats.usage.prompt_tokens > 8
    single = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float").data[0].embedding
    assert np.allclose(single, a[0], atol=1e-4)  # batching does not change a vector


def test_echo_with_logprobs(client):
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    tokens = choice.logprobs.tokens
    assert len(tokens) == out.usage.prompt_tokens + 3 and "".join(tokens) == choice.text
    assert choice.logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])


def test_cache_salt_keeps_one_tenants_prefix_cache_from_another(client):
    prompt = "Tenant isolation check. " * 12 + "Write one word:"

    def complete(salt: str) -> tuple[str, int]:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body={"cache_salt": salt})
        return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens

    first, cold = complete("tenant-a")
    again, warm = complete("tenant-a")
    other, other_cached = complete("tenant-b")
    assert cold == 0 and warm > 0 and other_cached == 0
    assert first == again == other  # isolation changes what is cached, never the answer
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": ""})


def test_logprobs_of_tokens_a_grammar_forbids_are_numbers(client):
    # Two tokens allowed, five alternatives asked: three come back at -inf in the
    # engine, which JSON cannot carry (it was a 500, and null when streamed).
    kwargs = dict(model=MODEL, prompt="Is water wet? Answer:", max_tokens=2, temperature=0, logprobs=5,
                  extra_body={"guided_choice": ["yes", "no"]})
    whole = client.completions.create(**kwargs)
    streamed = [c for chunk in client.completions.create(stream=True, **kwargs) for c in chunk.choices]
    for logprobs in [whole.choices[0].logprobs] + [c.logprobs for c in streamed if c.logprobs]:
        values = [v for top in logprobs.top_logprobs for v in top.values()] + logprobs.token_logprobs
        assert all(isinstance(v, float) and -9999.0 <= v <= 0 for v in values), values
    assert -9999.0 in [v for top in whole.choices[0].logprobs.top_logprobs for v in top.values()]
    chat = client.chat.completions.create(
        model=MODEL, messages=ask("Is water wet?"), max_tokens=3, temperature=0, logprobs=True, top_logprobs=5,
        response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": {"enum": ["yes", "no"]}}},
    )
    tops = [alt.logprob for item in chat.choices[0].logprobs.content for alt in item.top_logprobs]
    assert -9999.0 in tops and all(-9999.0 <= v <= 0 for v in tops)


def test_detokenize_undoes_tokenize_special_tokens_included(server):
    # /detokenize dropped special tokens ("<|im_start|>user\nhi<|im_end|>" came back "user\nhi").
    text = "<|im_start|>user\nhi<|im_end|>"
    tokens = server.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert server.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": text}
