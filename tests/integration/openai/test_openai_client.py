"""The official `openai` package against a live Kiln server (tiny random-weight model).

Random weights make the text meaningless but deterministic under greedy
sampling, which is what these tests compare: streamed vs whole answers, seeded
reruns, and stop strings cut at the right place.
"""

from __future__ import annotations

import pytest

from tests.integration.openai.live import kiln_server

EXACT = {"ignore_eos": True}  # random weights may sample EOS at any time


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with kiln_server(
        tiny_llama_dir, "--num-blocks", "256", "--served-model-name", "tiny", "--profile-activations",
        tmp_dir=tmp_path_factory.mktemp("openai"),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_models_lists_the_served_model(client):
    import openai

    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist"):
        client.models.retrieve("gpt-4")


def test_a_stop_string_in_the_last_allowed_token_still_stops(client):
    kw = dict(model="tiny", prompt="Count with me:", temperature=0, extra_body=EXACT)
    full = client.completions.create(max_tokens=6, **kw).choices[0].text
    last = client.completions.create(max_tokens=6, stop=[full[-2:]], **kw).choices[0]
    assert last.text == full[: full.find(full[-2:])] and last.finish_reason == "stop"


def test_stream_options_need_a_stream(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, stream_options={"include_usage": True})


def test_completion_whole_and_streamed_agree(client):
    whole = client.completions.create(
        model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0, extra_body=EXACT
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    stream = client.completions.create(
        model="tiny",
        prompt="The capital of France is",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXACT,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_whole_and_streamed_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=10, temperature=0, extra_body=EXACT
    )
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True, extra_body=EXACT
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 1


def test_n_choices(client):
    out = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, n=3, temperature=1.0, seed=5, extra_body=EXACT
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 24
    assert len({c.text for c in out.choices}) > 1  # seed + i per choice: different samples

    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2, stream=True, extra_body=EXACT
        )
    )
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1]


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model="tiny", prompt="Pick a word:", max_tokens=10, temperature=1.0, seed=seed, extra_body=EXACT
            )
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_stop_string_cuts_the_text(client):
    kw = dict(model="tiny", prompt="Count with me:", max_tokens=16, temperature=0, extra_body=EXACT)
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 :][:3]
    expected = full[: full.find(stop)]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert (cut.text, cut.finish_reason) == (expected, "stop")
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    out = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2, extra_body=EXACT
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=EXACT,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(item.top_logprobs) == 3 and item.logprob <= 0 for item in content)
    # greedy: the sampled token is the most likely one
    assert all(item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4) for item in content)


def test_errors_come_back_as_openai_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5, temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=5)


def test_profile_activations_reports_the_peak_on_metrics(server):
    peak = server.metric("kiln:model_memory_bytes", model="tiny", kind="activations_peak")
    # At least the largest step's logits were live: max_num_seqs (128) rows of the 49,152-token vocab, fp32.
    assert peak >= 128 * 49152 * 4
