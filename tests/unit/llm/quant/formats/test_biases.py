"""Pre-quantized projections with biases: a tiny Qwen2 (q/k/v biases, made
non-zero here) written as GPTQ and AWQ keeps its projections int4 and its
biases float; the logits and the greedy decode (the fused one-call decode
included) equal transformers' on the dequantized weights plus those biases,
and stay within the int4 bound of the float model. AutoGPTQ's all-zero
biases on projections that have none are dropped; a non-zero one is refused."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kiln import LLM, SamplingParams
from kiln.errors import ModelLoadError
from kiln.llm.models.loader import load_checkpoint
from kiln.llm.quant.int4_cpu import Int4CpuLinear
from tests.unit.llm.models.families import tiny
from tests.unit.llm.quant.formats.compare import IDS, check_int4_logits, kiln_model, relative_error
from tests.unit.llm.quant.formats.writers import is_projection, pack_awq, pack_gptq, rtn_int4, write_hf_dir

GROUP = 32
FORMATS = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
              "checkpoint_format": "gptq"}, lambda qz: pack_gptq(qz, zero_offset=1)),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
            pack_awq),
}
GREEDY = 8


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, smollm2_tokenizer) -> tuple:
    """A tiny Qwen2 directory whose q/k/v biases are non-zero (transformers initialises them to 0)."""
    directory = tiny.build(tmp_path_factory.mktemp("qwen2"), Qwen2Config, Qwen2ForCausalLM, smollm2_tokenizer,
                           tie_word_embeddings=True)
    model = tiny.hf_model(directory)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


def quantized_dir(tmp_path, base, model, fmt: str, extra: dict[str, torch.Tensor] | None = None):
    config, pack = FORMATS[fmt]
    tensors, reference = {}, {}
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if not is_projection(name):
            tensors[name] = w
            continue
        qz = rtn_int4(w, GROUP, sym=False, min_zero=1)
        reference[name] = qz.reference()
        for suffix, t in pack(qz).items():
            tensors[name.removesuffix("weight") + suffix] = t
    return write_hf_dir(tmp_path / fmt, base, {**tensors, **(extra or {})}, config), reference


def with_weights(model, state: dict[str, torch.Tensor]):
    replaced = type(model)(model.config).eval()
    replaced.load_state_dict({**model.state_dict(), **state}, strict=False)
    replaced.tie_weights()
    return replaced


def logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([IDS])).logits[0].float()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_biased_int4_projections_equal_the_dequantized_reference(tmp_path, qwen2, fmt):
    base, float_model = qwen2
    path, reference = quantized_dir(tmp_path, base, float_model, fmt)
    ckpt = load_checkpoint(path)
    assert set(ckpt.quantized) == set(reference)
    for name, tensor in float_model.state_dict().items():
        if name.endswith(".bias"):
            assert torch.equal(ckpt.weights[name], tensor), name  # kept float, as stored

    model = kiln_model(ckpt)
    assert isinstance(model.decoder_layers[0].self_attn.qkv_proj, Int4CpuLinear)
    assert model.decoder_layers[0].self_attn.qkv_bias is not None
    exact_model = with_weights(float_model, reference)
    exact = logits(exact_model)
    check_int4_logits(model, exact, logits(float_model))
    # Without the biases the output is far off: they are applied, not just loaded.
    assert relative_error(logits(with_weights(exact_model, {n: torch.zeros_like(t) for n, t in
                                                            float_model.state_dict().items() if n.endswith(".bias")})),
                          exact) > 1e-2

    llm = LLM(str(path), dtype="float32", kv_cache_memory_gib=0.02)
    assert llm.engine.core.runner.model.fused_layers is not None  # decode takes the one-call kernel, bias included
    params = SamplingParams(max_tokens=GREEDY, temperature=0.0, ignore_eos=True)
    got = llm.generate([IDS], params)[0].outputs[0].token_ids
    assert got == tiny.hf_greedy(exact_model, IDS, GREEDY)


def test_zero_biases_where_the_architecture_has_none_are_dropped(tmp_path, tiny_llama_dir, float_model):
    zeros = {name.removesuffix("weight") + "bias": torch.zeros(w.shape[0], dtype=torch.float16)
             for name, w in float_model.state_dict().items() if is_projection(name)}
    path, reference = quantized_dir(tmp_path, tiny_llama_dir, float_model, "gptq", zeros)
    ckpt = load_checkpoint(path)
    assert set(ckpt.quantized) == set(reference)
    assert not any(name.endswith(".bias") for name in ckpt.weights)


def test_a_non_zero_bias_where_the_architecture_has_none_is_refused(tmp_path, tiny_llama_dir, float_model):
    name = "model.layers.1.mlp.down_proj.bias"
    path, _ = quantized_dir(tmp_path, tiny_llama_dir, float_model, "awq", {name: torch.ones(64)})
    with pytest.raises(ModelLoadError, match=f"{name}: a non-zero bias on a projection that has none"):
        load_checkpoint(path)
