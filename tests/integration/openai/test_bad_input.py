"""Bad requests get the right status and a message naming the problem; the
server keeps serving. Limits here: max_tokens 256, body 20000 bytes, n 4."""

from __future__ import annotations

import pytest

from tests.integration.openai.live import kiln_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    flags = [
        "--num-blocks",
        "64",
        "--served-model-name",
        "tiny",
        "--max-tokens-limit",
        "256",
        "--max-request-bytes",
        "20000",
        "--max-n",
        "4",
    ]
    with kiln_server(tiny_llama_dir, *flags, tmp_dir=tmp_path_factory.mktemp("bad_input")) as s:
        yield s


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBED = "/v1/embeddings"
USER = [{"role": "user", "content": "hi"}]
BAD = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def NAMED(name: str) -> dict:  # noqa: N802 (reads as a constant in the table)
    return {"type": "function", "function": {"name": name}}


CASES = [
    # (path, json body or raw bytes, status, words the message must contain, param)
    (COMPLETIONS, b'{"prompt": "x", ', 400, ["invalid JSON"], None),
    (COMPLETIONS, b"", 400, ["empty"], None),
    (COMPLETIONS, b"[1, 2]", 400, ["JSON object"], None),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, ["temperature"], "temperature"),
    (COMPLETIONS, {"prompt": 5}, 400, ["prompt"], "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "10"}, 400, ["max_tokens"], "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "stream": 1}, 400, ["stream"], "stream"),
    (CHAT, {"messages": "hello"}, 400, ["messages"], "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, ["role"], "messages.0.role"),
    (COMPLETIONS, {"prompt": "x", "tools": []}, 400, ["unknown field", "tools"], "tools"),
    (CHAT, {"model": "tiny"}, 400, ["missing", "messages"], "messages"),
    (COMPLETIONS, {"prompt": ""}, 400, ["prompt", "empty"], "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, ["prompt", "empty"], "prompt"),
    (CHAT, {"messages": []}, 400, ["messages"], "messages"),
    (COMPLETIONS, {"prompt": "hello " * 600}, 400, ["tokens", "512"], "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 10**9}, 400, ["max_tokens", "256"], "max_tokens"),
    (COMPLETIONS, {"prompt": "hello " * 300, "max_tokens": 250}, 400, ["context", "512"], "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, ["max_tokens"], "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.5}, 400, ["temperature"], "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, ["top_p"], "top_p"),
    (COMPLETIONS, {"prompt": "x", "n": 5}, 400, ["n", "max_n"], "n"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, ["logprobs"], "logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, ["logprobs"], "top_logprobs"),
    (COMPLETIONS, {"prompt": [10**9]}, 400, ["token ids"], "prompt"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"x": 1}}, 400, ["logit_bias"], "logit_bias"),
    # int() reads these as 50: not token ids as written
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5_0": 1}}, 400, ["logit_bias", "'5_0'"], "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {" +50 ": 1}}, 400, ["logit_bias"], "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"\u0665\u0660": 1}}, 400, ["logit_bias"], "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, ["stop"], "stop.0"),  # the list item at fault
    (COMPLETIONS, {"prompt": "x" * 30000}, 400, ["20000", "max_request_bytes"], "max_request_bytes"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, ["gpt-4", "tiny"], "model"),
    # structured outputs
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400, ["response_format"], "response_format.type"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, 400, ["json_schema"],
     "response_format.json_schema"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}},
     400, ["schema", "nonsense"], "response_format"),
    (COMPLETIONS, {"prompt": "x", "guided_json": {"type": "object"}, "guided_regex": "a+"}, 400, ["at most one"],
     "guided_regex"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "(unclosed"}, 400, ["guided_regex", "parenthesis"],
     "guided_regex"),
    (COMPLETIONS, {"prompt": "x", "guided_choice": []}, 400, ["choice"], "structured_outputs.choice"),
    # tools
    (CHAT, {"messages": USER, "tools": [WEATHER], "tool_choice": NAMED("stocks")}, 400, ["stocks"], "tool_choice"),
    (CHAT, {"messages": USER, "tool_choice": "auto"}, 400, ["tool_choice", "tools"], "tool_choice"),
    (CHAT, {"messages": USER, "tools": [WEATHER, WEATHER]}, 400, ["distinct"], "tools"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, ["name"],
     "tools.0.function.name"),
    (CHAT, {"messages": USER, "tools": [WEATHER], "tool_choice": "required",
            "response_format": {"type": "json_object"}}, 400, ["response_format"], "response_format"),
    # media parts, echo, best_of
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     ["image", "tiny"], "messages.0.content.0"),
    (COMPLETIONS, {"prompt": "x", "best_of": 1, "n": 2}, 400, ["best_of"], "best_of"),
    (COMPLETIONS, {"prompt": "x", "best_of": 2, "stream": True}, 400, ["best_of", "stream"], "best_of"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 99}, 400, ["prompt_logprobs"], "prompt_logprobs"),
    # embeddings
    (EMBED, {"input": 5}, 400, ["input"], "input"),
    (EMBED, {"input": "x", "encoding_format": "hex"}, 400, ["encoding_format"], "encoding_format"),
    (EMBED, {"input": "x", "dimensions": 100000}, 400, ["dimensions"], "dimensions"),
    (EMBED, {"input": []}, 400, ["input"], "input"),
]


@pytest.mark.parametrize("path,body,status,words,param", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_bad_request(server, path, body, status, words, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = server.post(path, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]


def test_too_long_prompt_names_both_lengths(server):
    error = server.post(COMPLETIONS, json={"prompt": "hello " * 600}).json()["error"]
    assert "600" in error["message"] or "601" in error["message"]


def test_still_serving_after_bad_requests(server):
    assert server.get("/health").status_code == 200
    out = server.post(COMPLETIONS, json={"prompt": "Still alive?", "max_tokens": 3, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 3
    assert server.metric("kiln:num_requests_running") == 0
