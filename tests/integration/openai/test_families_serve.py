"""Every supported family behind `kiln serve`, the way a user meets it: tiny
random checkpoints (transformers' own config classes, SmolLM2's tokenizer and
the family's chat template) served by one server, Gemma 2 as the command-line
model and the others from a `--model-repository` of `llm` models, each on its
own engine. With the stock `openai` client, a chat completion (through the
checkpoint's template) and a streamed completion must be transformers' greedy
tokens on the same weights. And a checkpoint of an unsupported architecture is
refused up front, naming it and the supported ones."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from kiln.cli.main import main
from tests.integration.openai.live import free_port, kiln_server
from tests.unit.llm.models.families import tiny
from tests.unit.llm.models.families.test_gemma2 import GEMMA2
from tests.unit.llm.models.families.test_gemma3 import GEMMA3
from tests.unit.llm.models.families.test_mixtral import MIXTRAL
from tests.unit.llm.models.families.test_qwen3_moe import QWEN3_MOE

MESSAGES = [{"role": "user", "content": "Tell me a story about a small village by the sea."}]
PROMPT = "Once upon a time, in a small village,"
MAX_TOKENS = 8
COMMAND_LINE = "gemma2"  # served as `kiln serve <dir>`; the others from the repository


@dataclass(frozen=True)
class Family:
    config: type
    model: type
    template: str
    overrides: dict[str, Any]


FAMILIES = {
    "llama": Family(LlamaConfig, LlamaForCausalLM, "chatml", dict(tie_word_embeddings=False)),
    "mistral": Family(MistralConfig, MistralForCausalLM, "mistral", dict(sliding_window=16)),
    "qwen2": Family(Qwen2Config, Qwen2ForCausalLM, "chatml", dict(tie_word_embeddings=True)),
    "qwen3": Family(Qwen3Config, Qwen3ForCausalLM, "chatml", dict(tie_word_embeddings=False)),
    "gemma2": Family(Gemma2Config, Gemma2ForCausalLM, "gemma", GEMMA2),
    "gemma3": Family(Gemma3TextConfig, Gemma3ForCausalLM, "gemma", GEMMA3),
    "phi3": Family(Phi3Config, Phi3ForCausalLM, "phi3",
                   dict(partial_rotary_factor=0.5, sliding_window=16, pad_token_id=0)),
    "mixtral": Family(MixtralConfig, MixtralForCausalLM, "mistral", MIXTRAL),
    "qwen3_moe": Family(Qwen3MoeConfig, Qwen3MoeForCausalLM, "chatml", QWEN3_MOE),
}
# fp32 so that greedy choices equal transformers' fp32 ones (bf16 may flip near-ties).
ENGINE = {"dtype": "float32", "kv_cache_memory_gib": 0.02, "max_model_len": 256}


def build(directory: Path, name: str, tokenizer: Any) -> Path:
    f = FAMILIES[name]
    return tiny.build(directory, f.config, f.model, tokenizer, chat_template=tiny.TEMPLATES[f.template],
                      **f.overrides)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer) -> dict[str, Path]:
    """The command-line model's directory, and each other family as version 1 of
    a repository model whose weights sit in the version directory."""
    root = tmp_path_factory.mktemp("families")
    dirs = {COMMAND_LINE: build(root / COMMAND_LINE, COMMAND_LINE, smollm2_tokenizer)}
    for name in FAMILIES.keys() - {COMMAND_LINE}:
        dirs[name] = build(root / "repository" / name / "1" / "weights", name, smollm2_tokenizer)
        (root / "repository" / name / "config.yaml").write_text(yaml.safe_dump({
            "backend": "llm",
            "inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]}],
            "outputs": [{"name": "text_output", "datatype": "BYTES", "dims": [1]}],
            "parameters": {"model": "weights", **ENGINE},
        }))
    return dirs


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    repository = checkpoints["llama"].parents[2]
    engine = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    with kiln_server(checkpoints[COMMAND_LINE], *engine, "--served-model-name", COMMAND_LINE,
                     "--model-repository", str(repository), "--engine-mode", "thread",
                     tmp_dir=tmp_path_factory.mktemp("serve"), timeout=300) as s:
        yield s


def hf_greedy_text(directory: Path, ids: list[int]) -> str:
    hf_tokenizer = AutoTokenizer.from_pretrained(str(directory))
    return hf_tokenizer.decode(tiny.hf_greedy(tiny.hf_model(directory), ids, MAX_TOKENS), skip_special_tokens=True)


def test_every_family_is_served(server):
    assert sorted(m.id for m in server.openai().models.list().data) == sorted(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_through_the_checkpoint_template_matches_transformers(server, checkpoints, name):
    hf_tokenizer = AutoTokenizer.from_pretrained(str(checkpoints[name]))
    prompt = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert MESSAGES[0]["content"] in prompt and prompt != MESSAGES[0]["content"]  # the checkpoint's template
    ids = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]

    out = server.openai().chat.completions.create(
        model=name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == MAX_TOKENS
    assert out.choices[0].message.content == hf_greedy_text(checkpoints[name], ids)


@pytest.mark.parametrize("name", FAMILIES)
def test_streamed_completion_matches_transformers(server, checkpoints, name):
    ids = AutoTokenizer.from_pretrained(str(checkpoints[name]))(PROMPT, add_special_tokens=False)["input_ids"]
    chunks = list(server.openai().completions.create(
        model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert "".join(c.choices[0].text for c in chunks if c.choices) == hf_greedy_text(checkpoints[name], ids)


def test_unsupported_architecture_is_refused_naming_it_and_the_supported_ones(tmp_path, capsys):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 64, "n_embd": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["serve", str(tmp_path), "--port", str(free_port())]) == 2  # before any server or engine starts
    error = capsys.readouterr().err.strip()
    assert error.startswith("kiln: error: unsupported architecture GPT2LMHeadModel")
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma2ForCausalLM", "MixtralForCausalLM"):
        assert supported in error
