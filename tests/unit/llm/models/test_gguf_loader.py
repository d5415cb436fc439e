"""Loading llama GGUF files: a tiny synthetic one, and the real SmolLM2."""
from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from kiln.errors import ModelLoadError
from kiln.llm.models.gguf_loader import unpermute_rows
from kiln.llm.models.loader import load_checkpoint

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{_GGUF_NAMES['.'.join(rest[:-1])]}.weight"


def _write_llama_gguf(path: Path, model: LlamaForCausalLM, architecture: str = "llama") -> Path:
    """Write `model` as an F32 llama GGUF the way convert_hf_to_gguf.py does."""
    c = model.config
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = tensor.numpy().astype(np.float32)
        if "q_proj" in name:
            w = _llama_cpp_permute(w, c.num_attention_heads)
        elif "k_proj" in name:
            w = _llama_cpp_permute(w, c.num_key_value_heads)
        writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory) -> Path:
    return _write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_model)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for n_heads in (1, 2, 3):
        assert np.array_equal(unpermute_rows(_llama_cpp_permute(w, n_heads), n_heads), w)


def test_tiny_gguf_round_trip(tiny_gguf, tiny_model):
    ckpt = load_checkpoint(tiny_gguf)
    ref = tiny_model.state_dict()
    assert ckpt.weights.keys() == ref.keys()  # untied: lm_head present
    for name, tensor in ref.items():
        assert ckpt.weights[name].dtype == torch.float32
        assert torch.equal(ckpt.weights[name], tensor), name
    assert ckpt.arch.tie_word_embeddings is False
    assert (ckpt.arch.num_heads, ckpt.arch.num_kv_heads, ckpt.arch.head_dim) == (4, 2, 16)
    assert ckpt.tokenizer_path == str(tiny_gguf) == ckpt.source


def test_directory_with_one_gguf(tiny_gguf):
    # tiny_gguf sits alone in its temporary directory.
    ckpt = load_checkpoint(tiny_gguf.parent)
    assert ckpt.source == str(tiny_gguf)
    assert ckpt.is_gguf  # what `--kv-cache-dtype auto` decides on


def test_a_model_directory_is_not_gguf(tiny_llama_dir):
    assert not load_checkpoint(tiny_llama_dir).is_gguf


def test_directory_with_two_ggufs(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="several .gguf files") as e:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_non_llama_gguf(tiny_model, tmp_path):
    path = _write_llama_gguf(tmp_path / "gpt2.gguf", tiny_model, architecture="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'") as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


def test_truncated_gguf(smollm2_path, tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as f:
        path.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


def test_truncated_tensor_data(tiny_gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf.read_bytes()[: os.path.getsize(tiny_gguf) - 4096])
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


def test_garbage_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF file") as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


# --- the real model, checked against transformers' own GGUF loader ---


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smollm2_checkpoint, smollm2_hf_model):
    ref = smollm2_hf_model.state_dict()
    kiln = smollm2_checkpoint.dequantized_weights()  # the Q4_1 projections from their stored codes
    # Tied: transformers exposes lm_head as the embedding; kiln omits it.
    assert kiln.keys() == ref.keys() - {"lm_head.weight"}
    for name, tensor in kiln.items():
        assert tensor.dtype == torch.float32, name
        # Same dequantization, so normally bit-identical; allclose is the contract.
        assert torch.equal(tensor, ref[name]) or torch.allclose(tensor, ref[name], rtol=0, atol=1e-6), name


@pytest.mark.slow
def test_smollm2_arch_matches_transformers(smollm2_checkpoint, smollm2_hf_model):
    arch, c = smollm2_checkpoint.arch, smollm2_hf_model.config
    assert arch.vocab_size == c.vocab_size == 49152
    assert arch.hidden_size == c.hidden_size
    assert arch.intermediate_size == c.intermediate_size
    assert arch.num_layers == c.num_hidden_layers
    assert arch.num_heads == c.num_attention_heads
    assert arch.num_kv_heads == c.num_key_value_heads
    assert arch.head_dim == c.head_dim
    assert arch.rms_norm_eps == c.rms_norm_eps
    assert arch.rope_theta == c.rope_parameters["rope_theta"]
    assert arch.rope_scaling is None
    assert arch.max_position_embeddings == c.max_position_embeddings
    assert arch.tie_word_embeddings is True and c.tie_word_embeddings is True
    assert arch.bos_token_id == c.bos_token_id
    assert arch.eos_token_ids == (c.eos_token_id,)

