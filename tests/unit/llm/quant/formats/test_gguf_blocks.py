"""GGUF quantized blocks: Q4_0, Q4_1 and Q4_K load into Kiln's int4 layout
and dequantize to exactly what the gguf package's dequantizer gives; Q8_0
and Q6_K are dequantized (and the log says so). Files are written with the
gguf package's writer, its quantizers for Q4_0/Q4_1/Q8_0 and this suite's
for Q4_K/Q6_K (ggml-common.h's block layouts), from a small random Llama."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize, quantize
from transformers import LlamaForCausalLM

from kiln.errors import ModelLoadError
from kiln.llm.layers.linear import Linear
from kiln.llm.models.gguf_loader import GGUFFile
from kiln.llm.models.loader import load_checkpoint
from kiln.llm.quant.formats.gguf_blocks import gguf_int4_weight, q4_k_scale_min
from kiln.llm.quant.formats.int4_weight import Int4Weight
from kiln.llm.quant.int4_cpu import Int4CpuLinear
from tests.unit.llm.quant.formats.compare import check_int4_logits, hf_logits, kiln_model, small_llama
from tests.unit.llm.quant.formats.writers import encode, write_gguf

ATTN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight")
MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
FILES = {
    # every projection in one int4 type, embeddings Q8_0 (as SmolLM2's file)
    "Q4_0": {**{s: T.Q4_0 for s in (*ATTN, *MLP, "self_attn.v_proj.weight", "mlp.down_proj.weight")},
             "embed_tokens.weight": T.Q8_0},
    "Q4_1": {**{s: T.Q4_1 for s in (*ATTN, *MLP, "self_attn.v_proj.weight", "mlp.down_proj.weight")},
             "embed_tokens.weight": T.Q8_0},
    # llama.cpp's Q4_K_M mix: v and down in Q6_K, the rest Q4_K
    "Q4_K_M": {**{s: T.Q4_K for s in (*ATTN, *MLP)}, "self_attn.v_proj.weight": T.Q6_K,
               "mlp.down_proj.weight": T.Q6_K, "embed_tokens.weight": T.Q8_0, "lm_head.weight": T.Q6_K},
}


@pytest.fixture(scope="module")
def float_model() -> LlamaForCausalLM:
    """K-quants need rows of 256: a small Llama with hidden 256."""
    return small_llama(256)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_blocks_map_to_int4_exactly(qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    w[1] += 0.2  # an all-positive row: Q4_1 / Q4_K mins above zero
    raw = encode(w, qtype)
    weight = gguf_int4_weight(raw, qtype, 6, 512)
    assert isinstance(weight, Int4Weight)
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(raw, qtype)))
    # fp16 parameters only where fp16 holds them (Q4_K's d * sc is up to 17 bits)
    assert weight.scale_min.dtype == (torch.float32 if qtype == T.Q4_K else torch.float16)


def test_q4_k_scale_unpacking_matches_gguf():
    packed = np.random.default_rng(0).integers(0, 256, (50, 12), dtype=np.uint8)
    sc, m = q4_k_scale_min(packed)
    ref_sc, ref_m = Q4_K.get_scale_min(packed)
    assert np.array_equal(sc, ref_sc) and np.array_equal(m, ref_m)


def test_types_without_an_exact_int4_map_are_not_taken():
    w = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    assert gguf_int4_weight(quantize(w, T.Q8_0), T.Q8_0, 4, 256) is None
    assert gguf_int4_weight(encode(w, T.Q6_K), T.Q6_K, 4, 256) is None
    assert gguf_int4_weight(quantize(w[:, :96], T.Q4_0), T.Q4_0, 4, 96) is None  # K not a multiple of 64


@pytest.mark.parametrize("kind", list(FILES))
def test_gguf_file_loads_int4_exactly_and_serves_close_to_float(tmp_path, float_model, kind, caplog):
    path = write_gguf(tmp_path / f"{kind}.gguf", float_model.state_dict(), float_model.config, FILES[kind])
    with caplog.at_level(logging.INFO, logger="kiln.llm.models.gguf_loader"):
        ckpt = load_checkpoint(path)
    file = GGUFFile(path)
    exact_types = {T.Q4_0, T.Q4_1, T.Q4_K}
    for name in file.names:
        stored = next((t for s, t in FILES[kind].items() if name.endswith(s)), T.F32)
        kept = stored in exact_types and "embed" not in name and "lm_head" not in name
        assert (name in ckpt.quantized) == kept, name
        if kept:  # file.read: gguf's dequantization, un-permuted like the codes
            assert torch.equal(ckpt.quantized[name].dequantize(), file.read(name)), name
    dequantized = "1 Q8_0" if kind != "Q4_K_M" else "5 Q6_K, 1 Q8_0"  # v, down x 2 layers, the head
    assert f"dequantized to float32: {dequantized}" in caplog.text

    model = kiln_model(ckpt)
    layer = model.decoder_layers[0]
    if kind == "Q4_K_M":  # q, k (Q4_K) fuse with v (Q6_K): float; down (Q6_K): float
        assert isinstance(layer.self_attn.qkv_proj, Linear) and isinstance(layer.mlp.down_proj, Linear)
        assert isinstance(layer.self_attn.o_proj, Int4CpuLinear) and isinstance(layer.mlp.gate_up_proj, Int4CpuLinear)
    else:
        assert sum(isinstance(m, Int4CpuLinear) for m in model.modules()) == 4 * 2
        assert model.fused_layers is not None
    exact = hf_logits(float_model, ckpt.dequantized_weights())
    check_int4_logits(model, exact, hf_logits(float_model))


def test_float_mode_dequantizes_every_projection(tmp_path, float_model):
    path = write_gguf(tmp_path / "q4_1.gguf", float_model.state_dict(), float_model.config, FILES["Q4_1"])
    ckpt = load_checkpoint(path)
    model = kiln_model(ckpt, quantization="float")
    assert not any(isinstance(m, Int4CpuLinear) for m in model.modules())
    q = ckpt.quantized["model.layers.1.mlp.down_proj.weight"].dequantize()
    assert torch.equal(model.decoder_layers[1].mlp.down_proj.weight, q)


def test_a_type_kiln_cannot_read_is_refused_by_name(tmp_path, float_model):
    types = {**FILES["Q4_1"], "mlp.up_proj.weight": T.Q8_1}  # an intermediate type of llama.cpp's
    path = write_gguf(tmp_path / "q8_1.gguf", float_model.state_dict(), float_model.config, types)
    with pytest.raises(ModelLoadError, match=r"unsupported tensor type Q8_1 for blk\.0\.ffn_up\.weight"):
        load_checkpoint(path)


@pytest.mark.slow
def test_smollm2_q4_1_projections_are_its_stored_codes(smollm2_path, smollm2_checkpoint):
    file = GGUFFile(smollm2_path)
    assert len(smollm2_checkpoint.quantized) == 30 * 7  # every projection of every layer
    for name, weight in list(smollm2_checkpoint.quantized.items())[::5]:
        assert weight.source == "GGUF Q4_1" and weight.scale_min.dtype == torch.float16
        assert torch.equal(weight.dequantize(), file.read(name)), name
