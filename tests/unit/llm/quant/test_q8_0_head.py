"""The LM head kept in GGUF's Q8_0 blocks (kiln/llm/quant/q8_0_head.py): the
blocks read as gguf dequantizes them, `kiln::linear_q8_0` bit-identical to
`kiln::linear_f32` on the dequantized weight for every row count, the head
computing the float head's logits bit for bit on every path (kernel, packed
oneDNN copy, torch) and taking the kernel up to Q8_0_HEAD_MAX_ROWS rows (in the
avx512 / avx512_vnni builds at every row count, linear_f32's chain, no oneDNN copy kept; a bf16
model's too, through `kiln::linear_q8_0_bf16`, where the CPU has bf16 dot products), and
a GGUF whose head is Q8_0 (tied or not) served through it unless another
quantization is asked for; with int8 activations
(`--int4-activations int8`), `kiln::linear_q8_0a8` against exact integer block
sums and the same bits for a row in every batch."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from transformers import LlamaForCausalLM

from kiln.llm.kernels import ops
from kiln.llm.kernels.build import cpu_supported
from kiln.llm.kernels.ops import bf16_dot_products, kernels_loaded, pack_linear_weight, q8_0_lane_panels
from kiln.llm.kernels.tuning import Q8_0_HEAD_MAX_ROWS
from kiln.llm.layers.linear import project
from kiln.llm.models.loader import load_checkpoint
from kiln.llm.quant import q8_0_head
from kiln.llm.quant.int8 import Int8Linear
from kiln.llm.quant.int8_activations import use_int8_activations
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
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 32, 40, 100, 257):  # above 8 rows: lane panels (avx512, avx512_vnni)
            x = torch.randn(m, 160)
            q8 = torch.ops.kiln.linear_q8_0(x, weight.codes, weight.scales)
            assert torch.equal(q8, torch.ops.kiln.linear_f32(x, w)), m
    finally:
        torch.set_num_threads(previous)


@kernels
@pytest.mark.parametrize("name", ["linear_q8_0", "linear_q8_0a8"])
def test_kernels_name_bad_operands(name):
    weight, _ = blocks(4, 64)
    op = getattr(torch.ops.kiln, name)
    with pytest.raises(RuntimeError, match=f"{name}: fp32 scales"):
        op(torch.randn(1, 64), weight.codes, weight.scales[:, :1])
    with pytest.raises(RuntimeError, match=f"{name}: K must be a multiple of 32"):
        op(torch.randn(1, 48), weight.codes[:, :48].contiguous(), weight.scales)


@kernels
@pytest.mark.parametrize("packed", [True, False])
def test_head_computes_the_float_heads_logits_on_every_path(packed):
    weight, w = blocks(300, 128)
    copy = pack_linear_weight(w) if packed else None
    head = weight.head(w, copy)
    assert isinstance(head, Q8_0Head)
    assert head.takes_every_row == q8_0_lane_panels()
    # avx512(_vnni) builds: the blocks at every row count, linear_f32's chain (the float head's up to
    # PACKED_MIN_ROWS; the packed copy is never read). Others: the kernel up to 6 rows; then
    # linear_f32; the packed copy (or linear_f32) above 32; torch above 192.
    for m in (1, 6, 7, 32, 33, 192, 193):
        x = torch.randn(m, 128)
        expected = torch.ops.kiln.linear_f32(x, w) if head.takes_every_row else project(x, w, copy)
        assert torch.equal(head(x), expected), m
    # bf16 models keep their float head where the CPU has no bf16 dot products
    assert (weight.head(w.bfloat16(), None) is None) == (not bf16_dot_products())
    assert weight.head(w[:10], None) is None


@kernels
@pytest.mark.skipif(not bf16_dot_products(), reason="no bf16 dot products in the loaded kernel build")
@pytest.mark.parametrize("packed", [True, False])
def test_a_bf16_head_computes_the_bf16_float_heads_logits_on_every_path(packed):
    """The blocks widened and rounded to bf16 in registers, then linear_bf16's chain: the
    logits of the table a bf16 model holds, bit for bit, up to Q8_0_HEAD_MAX_ROWS rows (the
    bf16 kernel), then linear_bf16 / the packed copy / torch as project() chooses."""
    weight, w = blocks(203, 160, seed=3)  # N not a multiple of any tile, K = 5 blocks
    w16 = w.bfloat16()
    copy = pack_linear_weight(w16) if packed else None
    head = weight.head(w16, copy)
    assert isinstance(head, Q8_0Head)
    for m in (1, 2, 5, 6, 7, 16, 17, 48, 49):
        x = torch.randn(m, 160).bfloat16()
        assert torch.equal(head(x), project(x, w16, copy)), m
        assert torch.equal(torch.ops.kiln.linear_q8_0_bf16(x, weight.codes, weight.scales),
                           torch.ops.kiln.linear_bf16(x, w16)), m


@pytest.mark.skipif(not ops.bf16_dot_products(), reason="no bf16 dot products (AVX512_BF16) in the loaded build")
def test_a_bf16_head_with_its_copy_in_lane_layout_computes_the_float_heads_logits():
    """Where the copy for many rows is in lane layout (CPUs with AVX512_BF16, no AMX):
    the kernel up to Q8_0_HEAD_MAX_ROWS rows, linear_bf16 up to packed_min_rows, then the copy."""
    weight, w = blocks(208, 160, seed=4)
    w16 = w.bfloat16()
    copy = ops.bf16_lanes_copy(w16)
    head = weight.head(w16, copy)
    for m in (1, 6, 7, 8, 9, 16, 48, 49):
        x = torch.randn(m, 160).bfloat16()
        y = head(x)
        assert torch.equal(y, project(x, w16, copy)), m
        if m > ops.packed_min_rows(torch.bfloat16):
            assert torch.equal(y, ops.linear_bf16_lanes(x, copy)), m


@kernels
def test_head_takes_the_kernel_up_to_its_row_limit(monkeypatch):
    calls = []
    kernel = q8_0_head.linear_q8_0
    monkeypatch.setattr(q8_0_head, "linear_q8_0", lambda x, *a: calls.append(x.shape[0]) or kernel(x, *a))
    weight, w = blocks(64, 96)
    head = weight.head(w, None)
    rows = [1, Q8_0_HEAD_MAX_ROWS, Q8_0_HEAD_MAX_ROWS + 1, 32, 300]
    for m in rows:
        head(torch.randn(m, 96))
    assert calls == (rows if q8_0_lane_panels() else [1, Q8_0_HEAD_MAX_ROWS])


@kernels
@pytest.mark.skipif(not q8_0_lane_panels(), reason="needs the avx512 or avx512_vnni build (the Q8_0 lane panels)")
def test_a_q8_0_headed_model_keeps_no_onednn_copy_of_its_head(tmp_path, float_model):
    state = dict(float_model.state_dict())
    del state["lm_head.weight"]  # tied: the token embedding is the head
    gguf = write_gguf(tmp_path / "tied.gguf", state, float_model.config, {"embed_tokens.weight": T.Q8_0})
    ckpt = load_checkpoint(gguf)
    model = kiln_model(ckpt)
    assert isinstance(model.logits_head, Q8_0Head) and model.logits_head.takes_every_row
    assert model.lm_head_packed is None and model.logits_head.packed is None
    hidden = torch.randn(70, float_model.config.hidden_size)  # more rows than PACKED_MIN_ROWS: still the blocks
    assert torch.equal(model.compute_logits(hidden), torch.ops.kiln.linear_f32(hidden, model.lm_head.detach()))


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


def int8_activation_reference(x: torch.Tensor, weight) -> torch.Tensor:
    """Q8_0 x int8 activations in float64 from exact integer block sums: x quantized per
    row in the weight's blocks (sx = max|x| / 127, xq = round(x / sx), 1 for a zero block)."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    amax = xb.abs().amax(-1)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(xb * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)).unsqueeze(-1)).long()
    wq = weight.codes.view(weight.codes.shape[0], k // 32, 32).long()
    dots = torch.einsum("mbi,nbi->mnb", xq, wq).double()  # exact int block sums
    return (dots * weight.scales.double().unsqueeze(0) * sx.double().unsqueeze(1)).sum(-1)


@kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_activation_kernel_sums_exact_block_products_and_is_batch_invariant(threads):
    weight, w = blocks(203, 160, seed=threads)
    weight.codes[:5, :32] = -128  # a code a file may hold: |code| 128 must not overflow the products
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(40, 160)
        x[3, 32:64] = 0  # a zero block: scale 1, codes 0
        full = torch.ops.kiln.linear_q8_0a8(x, weight.codes, weight.scales)
        ref = int8_activation_reference(x, weight)
        assert torch.allclose(full.double(), ref, rtol=1e-5, atol=1e-5)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 32):  # every micro-kernel shape: the same bits per row
            assert torch.equal(torch.ops.kiln.linear_q8_0a8(x[:m], weight.codes, weight.scales), full[:m]), m
        dequantized = x @ weight.dequantize().T
        assert (full - dequantized).abs().max() < 0.02 * dequantized.abs().max()
    finally:
        torch.set_num_threads(previous)


@kernels
def test_int8_activation_kernel_names_bad_inputs():
    weight, _ = blocks(4, 64)
    with pytest.raises(RuntimeError, match="linear_q8_0a8: shape mismatch"):
        torch.ops.kiln.linear_q8_0a8(torch.randn(1, 32), weight.codes, weight.scales)
    with pytest.raises(RuntimeError, match="linear_q8_0a8: fp32 CPU x required"):
        torch.ops.kiln.linear_q8_0a8(torch.randn(1, 64).double(), weight.codes, weight.scales)


@kernels
def test_switched_head_multiplies_int8_activations_at_every_row_count():
    weight, w = blocks(300, 128)
    head = weight.head(w, pack_linear_weight(w))
    assert use_int8_activations(torch.nn.Sequential(torch.nn.Linear(4, 4), head)) == 1
    x = torch.randn(193, 128)
    full = head(x)
    assert torch.equal(full, torch.ops.kiln.linear_q8_0a8(x, weight.codes, weight.scales))
    assert not torch.equal(full, project(x, w, head.packed))
    for m in (1, 6, 32, 33, 192):  # the float head's paths change here (kernel, packed copy, torch): not this one
        assert torch.equal(head(x[:m]), full[:m]), m
    assert "int8 activations" in repr(head)
