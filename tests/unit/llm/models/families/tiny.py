"""Tiny random-weight checkpoints of each family, built with transformers'
own config and model classes, and the checks every family test runs on them:
Kiln against transformers on the same weights (prompt logits in fp32, greedy
continuations through the engine with prefix caching, chunked prefill and
preemption, speculative decoding), and a GGUF file written the way llama.cpp's
converter writes that family, whose load must equal the safetensors load.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kiln import LLM, SamplingParams
from kiln.llm.kernels import ops
from kiln.llm.models.loader import load_checkpoint
from tests.integration.llm.bench_text import mixed_prompts
from tests.integration.llm.prompt_logits import kiln_prompt_logits

GREEDY_TOKENS = 32

# Chat templates in each family's style (the real ones are longer; what
# matters here is that Kiln renders the checkpoint's own through transformers).
TEMPLATES = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
        "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
    ),
    "phi3": (
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
        "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
}
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]

# Shared by every family: SmolLM2's tokenizer (49152 tokens), 64 wide, 2 layers,
# heads of 16 (the CPU kernels' multiple), GQA 4:2. A wider init than
# transformers' 0.02 makes the logits less flat, so greedy choices have margins.
TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    initializer_range=0.08,
)


def build(directory: Path, config_class: type, model_class: type, tokenizer: Any, *,
          chat_template: str | None = None, **overrides: Any) -> Path:
    """Save a seeded random `model_class(config_class(**TINY, **overrides))`
    with SmolLM2's tokenizer (and `chat_template`, the family's)."""
    config = config_class(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    hf_tokenizer = tokenizer.hf
    if chat_template is not None:
        hf_tokenizer = tokenizer.with_chat_template(chat_template).hf
    hf_tokenizer.save_pretrained(directory)
    return directory


def hf_model(directory: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def hf_greedy(model: Any, ids: list[int], n: int = GREEDY_TOKENS) -> list[int]:
    """Plain argmax decoding with transformers' KV cache."""
    out_ids = []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            token = int(out.logits[0, -1].argmax())
            out_ids.append(token)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


@dataclass
class Reference:
    """transformers' answers for one tiny checkpoint, computed once per module."""

    directory: Path
    model: Any
    prompts: list[list[int]]  # mixed lengths, every other one sharing a 40-token prefix
    greedy: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, directory: Path, tokenizer: Any, num_prompts: int = 8) -> Reference:
        model = hf_model(directory)
        prompts = mixed_prompts(tokenizer, num_prompts)
        return cls(directory, model, prompts, [hf_greedy(model, p) for p in prompts])


def check_prompt_logits(llm: LLM, ref: Reference, atol: float) -> None:
    """Whole prompts, and their second halves over keys read back from the pool."""
    for ids in [llm.tokenizer.encode(t) for t in TEXT_PROMPTS] + ref.prompts[:3]:
        with torch.inference_mode():
            expected = ref.model(torch.tensor([ids])).logits[0].float()
        got = kiln_prompt_logits(llm, ids)
        assert (got - expected).abs().max().item() < atol
        split = len(ids) // 2
        got = kiln_prompt_logits(llm, ids, split)
        assert (got - expected[split:]).abs().max().item() < atol


def greedy_outputs(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def check_engine_matches_hf(ref: Reference, **options: Any) -> LLM:
    """All prompts in one continuous batch, with prefix caching, prefill chunks
    of 64 tokens and a pool small enough to preempt: each continuation must be
    transformers' greedy one for that prompt alone (so batch composition,
    caching and recomputation change nothing)."""
    llm = LLM(str(ref.directory), **{
        "dtype": "float32",
        "enable_prefix_caching": True, "max_num_batched_tokens": 64, "num_blocks": 32, "block_size": 16, **options,
    })
    outs = greedy_outputs(llm, ref.prompts)
    for i, (got, expected) in enumerate(zip(outs, ref.greedy, strict=True)):
        assert got == expected, f"prompt {i} ({len(ref.prompts[i])} tokens)"
    stats = llm.engine.last_stats
    assert stats is not None and stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return llm


def check_speculative_decoding(ref: Reference) -> None:
    """n-gram and truncated-draft speculation verify against the target: greedy output unchanged."""
    for options in (dict(spec_method="ngram"), dict(spec_method="draft", draft_num_layers=1)):
        llm = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.05, num_speculative_tokens=3, **options)
        # Two prompts keep it short; a tiny random model repeats itself, so n-gram drafts too.
        assert greedy_outputs(llm, ref.prompts[:2]) == ref.greedy[:2], options
        assert llm.engine.last_stats is not None and llm.engine.last_stats.spec_num_draft_tokens > 0


def check_int8(ref: Reference, atol: float, share: float = 1.0) -> None:
    """Weight-only int8 applies to every projection (the experts' too) and stays
    near fp32 at `share` of the positions (MoE: a token whose hidden state moves
    across a routing boundary goes to another expert, and its output with it).
    `atol` is for weight-only int8; with the VNNI kernel it is 1.5x that."""
    llm = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.05, quantization="int8")
    from kiln.llm.layers.linear import Linear

    assert not any(isinstance(m, Linear) for m in llm.engine.core.runner.model.modules())
    ids = ref.prompts[1]
    with torch.inference_mode():
        expected = ref.model(torch.tensor([ids])).logits[0].float()
    if ops.vnni_int8():  # activations quantized to int8 too (linear_w8a8): measured up to ~1.1x atol on these
        atol *= 1.5
    close = (kiln_prompt_logits(llm, ids) - expected).abs().amax(dim=-1) < atol
    assert close.float().mean().item() >= share


# --- GGUF, written as llama.cpp's convert_hf_to_gguf.py writes the family ---


@dataclass(frozen=True)
class GGUFConversion:
    """How llama.cpp converts a family: its architecture, and what it does to the values."""

    architecture: str  # gguf.MODEL_ARCH_NAMES value
    permute_qk: bool = False  # LlamaModel.permute (the "llama" architecture)
    norm_offset: float = 0.0  # Gemma: 1 added to every norm weight
    keys: dict[str, Any] = field(default_factory=dict)  # extra {arch}.* metadata, by writer method name


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")


def write_gguf(path: Path, directory: Path, conv: GGUFConversion) -> Path:
    """An F32 GGUF of the HF checkpoint in `directory`; tensor names from gguf's
    own TensorNameMap (llama.cpp's HF -> GGUF table), experts stacked."""
    c = json.loads((directory / "config.json").read_text())
    weights = load_file(str(directory / "model.safetensors"))
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == conv.architecture)
    names = gguf.get_tensor_name_map(arch, c["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, conv.architecture)
    heads = c["num_attention_heads"]
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(int(c["head_dim"] * rope.get("partial_rotary_factor", 1.0)))
    writer.add_vocab_size(c["vocab_size"])
    writer.add_bos_token_id(c["bos_token_id"])
    writer.add_eos_token_id(c["eos_token_id"])
    for method, value in conv.keys.items():
        getattr(writer, method)(value)
    stacked: dict[str, list[np.ndarray]] = {}
    for name, tensor in weights.items():
        if name == "lm_head.weight" and c.get("tie_word_embeddings"):
            continue
        w = tensor.float().numpy()
        if conv.norm_offset and name.endswith("norm.weight"):
            w = w + np.float32(conv.norm_offset)
        if conv.permute_qk and "q_proj" in name:
            w = _llama_cpp_permute(w, heads)
        elif conv.permute_qk and "k_proj" in name:
            w = _llama_cpp_permute(w, c["num_key_value_heads"])
        expert = _EXPERT.fullmatch(name)
        if expert is not None:
            stacked.setdefault(f"{expert.group(1)}.{expert.group(3)}", []).append(w)
            continue
        base, _, kind = name.rpartition(".")
        writer.add_tensor(f"{names.get_name(base)}.{kind}", w)
    for base, parts in stacked.items():
        writer.add_tensor(f"{names.get_name(base)}.weight", np.stack(parts))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def check_gguf_load_equals_safetensors(path: Path, directory: Path, arch_differs: dict[str, Any] | None = None):
    """Same weights (to float rounding of the converter's value changes) and the
    same arch, but for `arch_differs` (fields GGUF does not carry, with the
    values the GGUF load gets instead)."""
    from_gguf, from_hf = load_checkpoint(path), load_checkpoint(directory)
    assert from_gguf.weights.keys() == from_hf.weights.keys()
    for name, tensor in from_hf.weights.items():
        assert torch.allclose(from_gguf.weights[name], tensor.float(), rtol=0, atol=1e-6), name
    # GGUF stores the epsilon as float32.
    eps = float(np.float32(from_hf.arch.rms_norm_eps))
    expected = dataclasses.replace(from_hf.arch, rms_norm_eps=eps, **(arch_differs or {}))
    assert from_gguf.arch == expected
    return from_gguf
