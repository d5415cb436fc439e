"""A family other than Llama behind `kiln serve <dir>`, the way a user meets it:
a tiny random Gemma 2 checkpoint (sliding-window and soft-capped layers, its own
chat template) served and queried with the `openai` client; and a checkpoint
of an unsupported architecture refused up front, naming it and the supported ones."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM

from kiln.cli.main import main
from tests.integration.openai.live import free_port, kiln_server
from tests.unit.llm.models.families import tiny

GEMMA2 = dict(sliding_window=16, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
              query_pre_attn_scalar=32, num_hidden_layers=3, pad_token_id=0)
MESSAGES = [{"role": "user", "content": "Tell me a story about a small village by the sea."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, smollm2_tokenizer):
    return tiny.build(tmp_path_factory.mktemp("gemma2"), Gemma2Config, Gemma2ForCausalLM, smollm2_tokenizer,
                      chat_template=tiny.TEMPLATES["gemma"], **GEMMA2)


@pytest.fixture(scope="module")
def server(gemma2_dir, tmp_path_factory):
    with kiln_server(gemma2_dir, "--kv-cache-memory-gib", "0.05", "--served-model-name", "gemma2",
                     tmp_dir=tmp_path_factory.mktemp("serve")) as s:
        yield s


def test_chat_through_the_checkpoint_template_matches_transformers(server, gemma2_dir):
    hf_tokenizer = AutoTokenizer.from_pretrained(str(gemma2_dir))
    prompt = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith(hf_tokenizer.bos_token + "<start_of_turn>user\n")  # the checkpoint's template
    ids = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected = hf_tokenizer.decode(tiny.hf_greedy(tiny.hf_model(gemma2_dir), ids, MAX_TOKENS), skip_special_tokens=True)

    out = server.openai().chat.completions.create(
        model="gemma2", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == MAX_TOKENS
    assert out.choices[0].message.content == expected


def test_streamed_completion_equals_the_whole_one(server):
    client = server.openai()
    kw = dict(model="gemma2", prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == whole
    assert [m.id for m in client.models.list().data] == ["gemma2"]


def test_unsupported_architecture_is_refused_naming_it_and_the_supported_ones(tmp_path, capsys):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 64, "n_embd": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["serve", str(tmp_path), "--port", str(free_port())]) == 2  # before any server or engine starts
    error = capsys.readouterr().err.strip()
    assert error.startswith("kiln: error: unsupported architecture GPT2LMHeadModel")
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma2ForCausalLM", "MixtralForCausalLM"):
        assert supported in error
