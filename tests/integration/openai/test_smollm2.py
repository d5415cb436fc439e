"""The real SmolLM2 behind the server: chat template, real text, multi-byte streaming."""

from __future__ import annotations

import pytest

from tests.integration.openai.live import kiln_server

pytestmark = pytest.mark.slow

# Not France: its first token is a near tie in bf16 (`auto` on AVX512_BF16 CPUs), where "The"
# and "L" round to the same bf16 logit since the int4 lane kernel and greedy takes the lower id
# ("L'Étoile, ..."; fp32 and the older bf16 kernels answered Paris by 0.08-0.13 nats:
# docs/benchmarks.md, "int4 in lane layout"). Germany's answer leads by 0.66 (fp32) to 0.88 (bf16) nats.
GERMANY = [{"role": "user", "content": "What is the capital of Germany?"}]


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    with kiln_server(
        smollm2_path,
        "--kv-cache-memory-gib",
        "0.25",
        "--served-model-name",
        "smollm2",
        tmp_dir=tmp_path_factory.mktemp("smollm2"),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_chat_template_gives_a_real_answer(client, server):
    out = client.chat.completions.create(model="smollm2", messages=GERMANY, max_tokens=20, temperature=0)
    assert "Berlin" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"  # the model ended its turn itself
    tokenized = server.post("/tokenize", json={"messages": GERMANY}).json()
    assert tokenized["count"] == out.usage.prompt_tokens


def test_stop_string_on_real_text(client):
    out = client.chat.completions.create(
        model="smollm2", messages=GERMANY, max_tokens=20, temperature=0, stop=["Berlin"]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and "Berlin" not in choice.message.content
    assert choice.message.content.startswith("The capital of Germany is")


def test_streaming_never_splits_a_multibyte_character(client):
    # An answer of emoji (four bytes each, split over tokens). The prompt "Repeat exactly this text:
    # 😀 日本語 café 😀" answered in emoji until bf16 prefill attention rounded its weights to bf16
    # (as SDPA does); then a near tie gave plain text, so this prompt's answer is the one checked.
    messages = [{"role": "user", "content": "Write three emoji: 😀😀😀"}]
    kw = dict(model="smollm2", messages=messages, max_tokens=30, temperature=0)
    # Both answers below start from the same prefix-cache state: a cold prompt and its cached
    # repeat attend in other kernels (a short cached tail with the decodes, a whole prompt in
    # the prefill kernel), which sum in other orders, and in bf16 (`auto` on AVX512_BF16 CPUs)
    # a near tie can part them (docs/benchmarks.md, "Cached and cold prompts in bf16").
    client.chat.completions.create(**kw)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)]
    assert "".join(pieces) == whole
    assert not any("\ufffd" in p for p in pieces)
    assert any(len(ch.encode()) >= 3 for ch in whole)  # the answer has multi-byte characters
