"""Loading Hugging Face directories (config.json + safetensors), Llama's; errors of every family."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from kiln.errors import ModelLoadError
from kiln.llm.models.arch import RopeScaling
from kiln.llm.models.checkpoint import expected_weight_shapes
from kiln.llm.models.hf_loader import arch_from_config
from kiln.llm.models.loader import load_checkpoint

CONFIG = Path("/models/x/config.json")  # only used in error messages


def _reference_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    return LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_round_trip_untied(tiny_llama_dir):
    ckpt = load_checkpoint(tiny_llama_dir)
    ref = _reference_state_dict(tiny_llama_dir)
    assert ckpt.weights.keys() == ref.keys()
    for name, tensor in ref.items():
        assert torch.equal(ckpt.weights[name], tensor), name
    assert ckpt.tokenizer_path == str(tiny_llama_dir)
    assert ckpt.source == str(tiny_llama_dir)


def test_arch_untied(tiny_llama_dir):
    arch = load_checkpoint(tiny_llama_dir).arch
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (49152, 64, 128)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (2, 4, 2, 16)
    assert arch.rope_theta == 10000.0 and arch.rope_scaling is None
    assert arch.max_position_embeddings == 512
    assert arch.rms_norm_eps == 1e-6
    assert arch.tie_word_embeddings is False
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2,)


def test_llama3_rope_and_tied(tiny_llama3_dir):
    ckpt = load_checkpoint(tiny_llama3_dir)
    assert ckpt.arch.tie_word_embeddings is True
    assert ckpt.arch.rope_theta == 500000.0
    assert ckpt.arch.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 128)
    assert "lm_head.weight" not in ckpt.weights
    ref = _reference_state_dict(tiny_llama3_dir)
    for name, tensor in ckpt.weights.items():
        assert torch.equal(tensor, ref[name]), name


def test_sharded_directory(tiny_llama_dir, tmp_path):
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ckpt = load_checkpoint(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(ckpt.weights[name], tensor), name


def test_weight_names_match_expected_shapes(tiny_llama_dir):
    ckpt = load_checkpoint(tiny_llama_dir)
    shapes = {name: tuple(t.shape) for name, t in ckpt.weights.items()}
    assert shapes == expected_weight_shapes(ckpt.arch)


# --- config.json parsing, without files ---


def _config(**overrides):
    base = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    return {**base, **overrides}


def test_old_style_config_defaults():
    arch = arch_from_config(_config(rope_theta=5e5, eos_token_id=[7, 8]), CONFIG)
    assert arch.num_kv_heads == 4  # defaults to num_attention_heads
    assert arch.head_dim == 16  # hidden / heads
    assert arch.rope_theta == 5e5
    assert arch.eos_token_ids == (7, 8)
    assert arch.tie_word_embeddings is False  # Llama default
    assert arch.bos_token_id is None


def test_old_style_llama3_rope_scaling():
    scaling = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    arch = arch_from_config(_config(rope_scaling=scaling), CONFIG)
    assert arch.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)


def test_extra_eos_ids_are_merged_without_duplicates():
    arch = arch_from_config(_config(eos_token_id=2), CONFIG, extra_eos_ids=(5, 2))
    assert arch.eos_token_ids == (2, 5)


@pytest.mark.parametrize("scaling", [{"type": "dynamic", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0}])
def test_other_rope_scaling_is_rejected(scaling):
    with pytest.raises(ModelLoadError, match="unsupported rope_scaling type") as e:
        arch_from_config(_config(rope_scaling=scaling), CONFIG)
    assert str(CONFIG) in str(e.value)


def test_gemma_ties_its_head_when_the_config_does_not_say():
    # Google's published Gemma 2 / 3 configs have no tie_word_embeddings: their config
    # classes default to True (Llama's to False); Kiln looked for an lm_head and failed.
    gemma2 = _config(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16)
    gemma3 = _config(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16)
    assert arch_from_config(gemma2, CONFIG).tie_word_embeddings is True
    assert arch_from_config(gemma3, CONFIG).tie_word_embeddings is True
    assert arch_from_config({**gemma2, "tie_word_embeddings": False}, CONFIG).tie_word_embeddings is False
    assert arch_from_config(_config(), CONFIG).tie_word_embeddings is False


@pytest.mark.parametrize(("overrides", "message"), [
    ({"num_key_value_heads": 3}, r"attention heads \(4\) must be a multiple of the key/value heads \(3\)"),
    ({"num_key_value_heads": 8}, r"attention heads \(4\) must be a multiple of the key/value heads \(8\)"),
    ({"num_attention_heads": 0}, "num_attention_heads must be positive, got 0"),
    ({"head_dim": 15}, r"rotated dims of a head \(15\) must be even"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be positive, got 0"),
    ({"vocab_size": -1}, "vocab_size must be positive"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 8},
     r"experts per token \(8\) must be between 1 and the number of experts \(4\)"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 0},
     r"experts per token \(0\) must be between 1"),
])
def test_impossible_sizes_fail_the_load_naming_them(overrides, message):
    # Each loaded, answered /health, then failed every request with a torch error (or ZeroDivisionError).
    with pytest.raises(ModelLoadError, match=message) as e:
        arch_from_config(_config(**overrides), CONFIG)
    assert str(CONFIG) in str(e.value)


def test_missing_required_key():
    config = _config()
    del config["hidden_size"]
    with pytest.raises(ModelLoadError, match="missing hidden_size"):
        arch_from_config(config, CONFIG)


# --- errors on disk ---


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        load_checkpoint(missing)
    assert str(missing) in str(e.value)


def test_directory_without_weights(tiny_llama_dir, tmp_path):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors") as e:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_empty_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="no model found") as e:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(e.value)


@pytest.mark.parametrize("arch", ["FalconForCausalLM", "GPT2LMHeadModel"])
def test_unsupported_architecture_names_the_supported_ones(tiny_llama_dir, tmp_path, arch):
    directory = _copy_dir(tiny_llama_dir, tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = [arch]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"unsupported architecture {arch}") as e:
        load_checkpoint(directory)
    assert str(directory / "config.json") in str(e.value)
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma2ForCausalLM", "MixtralForCausalLM"):
        assert supported in str(e.value)


def test_mistral_with_sliding_window_slides_every_layer(tiny_llama_dir, tmp_path):
    directory = _copy_dir(tiny_llama_dir, tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096)
    (directory / "config.json").write_text(json.dumps(config))
    arch = load_checkpoint(directory).arch
    assert (arch.family, arch.layer_windows) == ("mistral", (4096, 4096))


def test_llama_with_biases_is_rejected(tiny_llama_dir, tmp_path):
    directory = _copy_dir(tiny_llama_dir, tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config.update(attention_bias=True)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="biases"):
        load_checkpoint(directory)


def test_invalid_json_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_corrupt_safetensors(tiny_llama_dir, tmp_path):
    directory = _copy_dir(tiny_llama_dir, tmp_path / "m")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="corrupt safetensors") as e:
        load_checkpoint(directory)
    assert str(weights) in str(e.value)


def test_weights_not_matching_config(tiny_llama_dir, tmp_path):
    directory = _copy_dir(tiny_llama_dir, tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="missing weights model.layers.2"):
        load_checkpoint(directory)


def test_other_file_kind(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="unsupported model file") as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


class _Trap:
    """Unpickling this object runs code: it creates the file it names."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickled_checkpoint_is_never_unpickled(tiny_llama_dir, tmp_path):
    directory = _copy_dir(tiny_llama_dir, tmp_path / "pickled")
    for weights in directory.glob("*.safetensors"):
        weights.unlink()
    marker = tmp_path / "unpickled"
    torch.save({"model.embed_tokens.weight": _Trap(marker)}, directory / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"pickled \.bin files are not loaded"):
        load_checkpoint(directory)
    assert not marker.exists()


def test_a_tensor_stored_in_two_shards_is_refused(tiny_llama_dir, tmp_path):
    # Without an index, the later file won in silence (a model answering token 0 over and over).
    from safetensors.torch import load_file, save_file

    directory = _copy_dir(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    save_file({name: torch.zeros_like(tensors[name])}, directory / "zz-extra.safetensors")
    with pytest.raises(ModelLoadError, match=f"tensor {name} is stored in both model.safetensors and "
                                             "zz-extra.safetensors"):
        load_checkpoint(directory)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_a_float_weight_stored_as_integers_is_refused(tiny_llama_dir, tmp_path, dtype):
    # copy_ cast the integers into the float parameter: a wrong model, no error.
    from safetensors.torch import load_file, save_file

    from tests.unit.llm.quant.formats.compare import kiln_model

    directory = _copy_dir(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ModelLoadError, match=f"weight {name} is stored as {dtype}; Kiln reads float weights"):
        kiln_model(load_checkpoint(directory))
