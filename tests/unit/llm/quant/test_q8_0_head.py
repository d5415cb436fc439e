"""The LM head kept in GGUF's Q8_0 blocks (kiln/llm/quant/q8_0_head.py): the
blocks read as gguf dequantizes them, `kiln::linear_q8_0` bit-identical to
`kiln::linear_f32` on the dequantized weight for every row count, the head
computing the float head's logits bit for bit on every path (kernel, packed
oneDNN copy, torch), and a GGUF whose head is Q8_0 (tied or not) served
through it unless another quantization is asked for."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from transformers import LlamaForCausalLM

from kiln.llm.kernels.build import cpu_supported
from kiln.llm.kernels.ops import kernels_loaded, pack_linear_weight
from kiln.llm.layers.linear import project
from kiln.llm.models.loader import load_checkpoint
from kiln.llm.quant.int8 import Int8Linear
from kiln.llm.quant.q8_0_head import Q8_0Head, q8_0_weight
from tests.unit.llm.quant.formats.compare import kiln_logits, kiln_model, small_llama
from tests.unit.llm.quant.formats.writers import write_gguf

# kernels_loaded() also loads the library (the ops are called directly here).
kernels = pytest.mark.skipif(not (cpu_supported() and kernels_loaded()),
                             reason="CPU without AVX2/FMA: kernels are not built")


def blocks(rows: int, cols: int, seed: int = 0):
    w = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)
    raw = quantize(w, T.Q8_0)
    return q8_0_weight(raw, rows, cols), torch.from_numpy(dequantize(raw, T.Q8_0))


def test_blocks_read_as_gguf_dequantizes_them():
    weight, reference = blocks(7, 96)
    assert weight.codes.dtype == torch.int8 and weight.scales.shape == (7, 3)
    assert torch.equal(weight.dequantize(), reference)
    with pytest.raises(ValueError, match="not a Q8_0 tensor"):
        q8_0_weight(quantize(np.zeros((2, 64), np.float32), T.Q8_0), 2, 96)


@kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_is_linear_f32_on_the_dequantized_weight(threads):
    weight, w = blocks(203, 160, seed=threads)  # N not a multiple of any tile, K = 5 blocks
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 32, 40):
            x = torch.randn(m, 160)
            q8 = torch.ops.kiln.linear_q8_0(x, weight.codes, weight.scales)
            assert torch.equal(q8, torch.ops.kiln.linear_f32(x, w)), m
    finally:
        torch.set_num_threads(previous)


@kernels
def test_kernel_names_bad_operands():
    weight, _ = blocks(4, 64)
    with pytest.raises(RuntimeError, match="linear_q8_0: fp32 scales"):
        torch.ops.kiln.linear_q8_0(torch.randn(1, 64), weight.codes, weight.scales[:, :1])
    with pytest.raises(RuntimeError, match="linear_q8_0: K must be a multiple of 32"):
        torch.ops.kiln.linear_q8_0(torch.randn(1, 48), weight.codes[:, :48].contiguous(), weight.scales)


@kernels
@pytest.mark.parametrize("packed", [True, False])
def test_head_computes_the_float_heads_logits_on_every_path(packed):
    weight, w = blocks(300, 128)
    copy = pack_linear_weight(w) if packed else None
    head = weight.head(w, copy)
    assert isinstance(head, Q8_0Head)
    for m in (1, 6, 32, 33, 192, 193):  # kernel; packed copy (or the kernel) above 32; torch above 192
        x = torch.randn(m, 128)
        assert torch.equal(head(x), project(x, w, copy)), m
    assert weight.head(w.bfloat16(), None) is None  # bf16 models keep their float head
    assert weight.head(w[:10], None) is None


@pytest.fixture(scope="module")
def float_model() -> LlamaForCausalLM:
    return small_llama(128)


@kernels
@pytest.mark.parametrize("tied", [False, True])
def test_a_gguf_q8_0_head_serves_through_its_blocks(tmp_path, float_model, tied):
    state = dict(float_model.state_dict())
    if tied:  # llama.cpp writes no output tensor: the token embedding is the head
        del state["lm_head.weight"]
    types = {"embed_tokens.weight" if tied else "lm_head.weight": T.Q8_0}
    ckpt = load_checkpoint(write_gguf(tmp_path / "head.gguf", state, float_model.config, types))
    assert ckpt.arch.tie_word_embeddings == tied and ckpt.stored_head is not None
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert torch.equal(ckpt.stored_head.dequantize(), ckpt.weights[head_name])
    model = kiln_model(ckpt)
    assert isinstance(model.logits_head, Q8_0Head)
    logits = kiln_logits(model)
    model.quantize_head(None)  # back to the float head
    assert torch.equal(logits, kiln_logits(model))
    assert kiln_model(ckpt, quantization="float").logits_head is None
    assert isinstance(kiln_model(ckpt, quantization="int8").logits_head, Int8Linear)


def test_other_head_types_keep_the_float_head(tmp_path, float_model):
    ckpt = load_checkpoint(write_gguf(tmp_path / "f32.gguf", float_model.state_dict(), float_model.config,
                                      {"embed_tokens.weight": T.Q8_0}))  # untied: the head is F32
    assert ckpt.stored_head is None
    assert ckpt.without_weights().stored_head is None
