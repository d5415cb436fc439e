"""kiln::decode_layer (one call per layer for decode-only steps) against the
module path it replaces: the same kernels in the same order, so hidden
states and the KV pool must be bit-identical, for fp32, int8, int4 and
bf16 models, one or several decode groups; and it stays out of steps it
does not cover. Mixture-of-experts layers (Mixtral, Qwen3-MoE) fuse their
attention half (kiln::decode_attention), route in Python and run their
experts through kiln::moe_experts between calls: bit-identical too. So do
Gemma 2 and 3's layers (sandwich norms, GeGLU, query_pre_attn_scalar's
scale, soft-capped scores, window layers; Gemma 3's with their own rope)."""
import dataclasses

import pytest
import torch

from kiln.llm.attention.metadata import AttentionMetadata, PrefillSeq
from kiln.llm.kernels import ops
from kiln.llm.kernels.build import cpu_supported
from kiln.llm.kernels.ops import decode_profile, packed_min_rows
from kiln.llm.kernels.tuning import INT4_DEQUANT_MIN_ROWS, PACKED_MIN_ROWS
from kiln.llm.models import fused_decode
from kiln.llm.models.arch import LlamaArch, MoEShape
from kiln.llm.models.gemma import GemmaModel
from kiln.llm.models.llama import LlamaModel
from kiln.llm.models.moe import SparseMoeBlock
from kiln.llm.quant.int4_lanes import Int4LaneLinear
from kiln.llm.quant.int8_activations import use_int8_activations
from kiln.llm.runner.inputs import decode_group

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not built")

ARCH = LlamaArch(
    vocab_size=300, hidden_size=128, intermediate_size=192, num_layers=3, num_heads=8, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
    tie_word_embeddings=True, rope_scaling=None, bos_token_id=1, eos_token_ids=(2,),
)
# Layer 1 dense (as Qwen3-MoE's mlp_only_layers), 0 and 2 sparse.
MOE_ARCH = dataclasses.replace(
    ARCH, moe=MoEShape(num_experts=4, top_k=2, intermediate_size=128, renormalize=True, dense_layers=(1,))
)
BLOCK, BLOCKS_PER_SEQ = 16, 7
# Gemma 2: window layers 0 and 2 (the window, 12, is shorter than most contexts of decode_step).
GEMMA2_ARCH = dataclasses.replace(
    ARCH, family="gemma2", norm_plus_one=True, sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=128**0.5,
    query_scale=24.0**-0.5, attn_logit_softcap=2.0, final_logit_softcap=30.0, layer_windows=(12, 0, 12),
)
GEMMA3_ARCH = dataclasses.replace(
    GEMMA2_ARCH, family="gemma3", attn_logit_softcap=None, final_logit_softcap=None, qk_norm=True,
    local_rope_theta=500.0,
)


def model_in(mode: str, arch: LlamaArch = ARCH) -> LlamaModel:
    torch.manual_seed(0)
    model = (GemmaModel if arch.sandwich_norms else LlamaModel)(arch, max_positions=256)
    for name, p in model.named_parameters():
        norm = "layernorm" in name or name == "norm.weight" or name.endswith("_norm.weight")
        p.data.normal_(1.0, 0.1) if norm else p.data.normal_(0, 0.05)
    quantization = {"fp32": None, "bf16": None, "int8": "int8", "int8-bf16": "int8"}.get(mode, "int4")
    dtype = torch.bfloat16 if mode in ("bf16", "int4-bf16", "int4-bf16-copy", "int8-bf16") else torch.float32
    model.finish(torch.device("cpu"), dtype, quantization, group_size=32)
    if mode == "int4-a8":  # --int4-activations int8, as the engine builder switches it
        use_int8_activations(model)
        model.fused_layers = model.gather_fused_layers()
    if mode == "int4-bf16-copy":  # --int4-prefill-weights bf16 without AMX: a bf16 copy in lane layout, 16+ rows
        for m in model.modules():
            if type(m) is Int4LaneLinear:
                m.pack(in_lanes=True)
        model.fused_layers = model.gather_fused_layers()
    return model


def decode_step(batch: int, pool_dtype: torch.dtype = torch.float32):
    """Inputs of a decode-only step: sequence b has context 3 + 5 (b % 20) (its
    new token included) in blocks b * BLOCKS_PER_SEQ ..."""
    g = torch.Generator().manual_seed(batch)
    ctx = [3 + 5 * (b % 20) for b in range(batch)]
    tables = [list(range(b * BLOCKS_PER_SEQ, (b + 1) * BLOCKS_PER_SEQ)) for b in range(batch)]
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, ctx, strict=True)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_size=BLOCK, num_decodes=batch)
    rows = list(zip(tables, ctx, strict=True))
    for first in range(0, batch, 16):
        meta.decode_groups.append(decode_group(first, rows[first : first + 16], BLOCK, torch.tensor))
    ids = torch.randint(3, ARCH.vocab_size, (batch,), generator=g)
    pool = [torch.randn(2, batch * BLOCKS_PER_SEQ * BLOCK, ARCH.num_kv_heads, ARCH.head_dim, generator=g).to(pool_dtype)
            for _ in range(ARCH.num_layers)]
    return ids, torch.tensor(ctx) - 1, pool, meta


def assert_fused_step_is_the_module_path(model: LlamaModel, batch: int, pool_dtype: torch.dtype) -> None:
    """One decode step with the fused layers and one through the modules: hidden states and pools equal."""
    ids, positions, pool, meta = decode_step(batch, pool_dtype)
    fused_pool = [p.clone() for p in pool]
    layers = model.fused_layers
    with torch.inference_mode():
        fused = model(ids, positions, fused_pool, meta)
        model.fused_layers = None
        reference = model(ids, positions, pool, meta)
    model.fused_layers = layers
    assert torch.equal(fused, reference)
    assert all(torch.equal(a, b) for a, b in zip(fused_pool, pool, strict=True))


@pytest.mark.parametrize(
    "mode,pool_dtype",
    [("fp32", torch.float32), ("int8", torch.float32), ("int4", torch.float32),
     ("fp32", torch.float16), ("int4", torch.bfloat16),  # 16-bit KV pools (kv_cache_dtype)
     ("bf16", torch.bfloat16), ("bf16", torch.float32),  # a bf16 model: its own pool dtype, or fp32
     ("int4-bf16", torch.bfloat16),  # a bf16 model keeping int4 projections (a GGUF's under --dtype auto here)
     ("int4-bf16-copy", torch.bfloat16),  # and their bf16 copy in lane layout (20 rows take it)
     ("int8-bf16", torch.bfloat16),  # --quantization int8 in a bf16 model: rows widened to fp32, rounded once
     ("int4-a8", torch.float32)],  # int4 projections on int8 activations (--int4-activations int8)
)
@pytest.mark.parametrize("batch", [1, 5, 20])  # 20 rows: two decode groups
def test_fused_step_is_bit_identical_to_the_module_path(mode, pool_dtype, batch):
    model = model_in(mode)
    assert model.fused_layers is not None and len(model.fused_layers) == ARCH.num_layers
    assert_fused_step_is_the_module_path(model, batch, pool_dtype)


@pytest.mark.parametrize(
    "mode,qk_norm,inter",
    [("fp32", False, 128), ("int8", False, 128), ("int4", False, 128), ("bf16", False, 128),  # Mixtral's layer
     ("fp32", True, 128), ("int8", True, 128),  # Qwen3-MoE's (q/k norms: fp32 models only)
     ("int4-bf16", False, 128), ("int4-bf16-copy", False, 128), ("int8-bf16", False, 128), ("int4-a8", False, 128),
     ("int4", False, 96)],  # experts' down_proj K=96 is no multiple of 64: not the kernel's int4, the block runs as is
)
@pytest.mark.parametrize("batch", [1, 5, 20])  # 1: the MoE block's one-token path; 20: two decode groups
def test_moe_layers_fuse_attention_and_experts_bit_identically(mode, qk_norm, inter, batch):
    moe = dataclasses.replace(MOE_ARCH.moe, intermediate_size=inter)
    model = model_in(mode, dataclasses.replace(MOE_ARCH, qk_norm=qk_norm, moe=moe))
    layers = model.fused_layers
    assert layers is not None and [f.moe is not None for f in layers] == [True, False, True]
    assert all(type(f.moe) is SparseMoeBlock for f in (layers[0], layers[2]))
    # [w], [w, scales], [codes, sm]; [lanes, params, copy] where the build lays int4 out in lanes
    width = 3 if mode == "int4-bf16-copy" and ops.bf16_dot_products() else 1 if mode in ("fp32", "bf16") else 2
    per_expert = width if inter % 64 == 0 else 0
    assert len(layers[0].gate_up) == len(layers[0].down) == moe.num_experts * per_expert
    assert (layers[0].q_norm is not None) == qk_norm
    assert_fused_step_is_the_module_path(model, batch, model.embed_tokens.dtype)


@pytest.mark.parametrize(
    "arch,mode",
    [(GEMMA2_ARCH, "fp32"), (GEMMA2_ARCH, "int8"), (GEMMA2_ARCH, "int4"), (GEMMA2_ARCH, "bf16"),
     (GEMMA2_ARCH, "int4-bf16"),  # a bf16 Gemma 2 keeping int4 projections: GeGLU and sandwich norms on widened rows
     (GEMMA3_ARCH, "fp32"), (GEMMA3_ARCH, "int4")],  # Gemma 3's q/k norms: fp32 models only
)
@pytest.mark.parametrize("batch", [1, 5, 20])
def test_gemma_layers_fuse_bit_identically(arch, mode, batch):
    model = model_in(mode, arch)
    layers = model.fused_layers
    assert layers is not None and all(f.gelu and f.attn_out_norm is not None and f.mlp_out_norm is not None
                                      for f in layers)
    assert [f.window for f in layers] == [12, 0, 12]
    assert [f.local_rope for f in layers] == ([True, False, True] if arch.local_rope_theta else [False] * 3)
    assert {f.softcap for f in layers} == {arch.attn_logit_softcap or 0.0}
    assert_fused_step_is_the_module_path(model, batch, model.embed_tokens.dtype)


@pytest.mark.parametrize(
    "arch,mode", [(ARCH, "fp32"), (ARCH, "bf16"), (ARCH, "int4-bf16"), (ARCH, "int4-bf16-copy"), (GEMMA3_ARCH, "fp32")]
)
def test_a_dense_model_steps_in_one_stack_call_bit_identical_to_per_layer_calls(arch, mode):
    model = model_in(mode, arch)
    layers = model.fused_layers
    assert layers is not None and layers.stack is not None and layers.stack.size() == arch.num_layers
    assert layers.whole_steps  # embedding, rope tables and final norm in the stack's call too (vs Python's below)
    ids, positions, pool, meta = decode_step(20 if mode.endswith("copy") else 5, model.embed_tokens.dtype)
    per_layer_pool = [p.clone() for p in pool]
    stack = layers.stack
    with torch.inference_mode():
        stacked = model(ids, positions, pool, meta)
        layers.stack = None  # fused_decode.run falls back to one kiln::decode_layer call per layer
        per_layer = model(ids, positions, per_layer_pool, meta)
    layers.stack = stack
    assert torch.equal(stacked, per_layer)
    assert all(torch.equal(a, b) for a, b in zip(pool, per_layer_pool, strict=True))


@pytest.mark.parametrize("arch,mode", [(ARCH, "bf16"), (GEMMA2_ARCH, "bf16"), (GEMMA3_ARCH, "fp32")])
def test_a_whole_step_call_embeds_ropes_and_norms_as_forward_does(arch, mode, monkeypatch):
    """The stack's ends against LlamaModel's: embedding (Gemma: times its scale rounded to bf16), the
    rope tables at each row's position (Gemma 3: the local ones too), the final norm; one call a step."""
    model = model_in(mode, arch)
    layers = model.fused_layers
    calls = []
    step = fused_decode.step
    monkeypatch.setattr(fused_decode, "step", lambda *a: calls.append(1) or step(*a))
    ids, positions, pool, meta = decode_step(3, model.embed_tokens.dtype)
    with torch.inference_mode():
        whole = model(ids, positions, [p.clone() for p in pool], meta)
        x, rope, local = model.layer_inputs(ids, positions)
        tables, lens = meta.decode_tables()
        expected = model.norm(layers.stack.run(x, *rope, *local, pool, meta.slot_mapping, [tables], [lens],
                                               meta.block_size))
    assert calls == [1]
    assert torch.equal(whole, expected)


def test_moe_models_keep_per_layer_calls_and_the_stack_checks_its_pools():
    assert model_in("fp32", MOE_ARCH).fused_layers.stack is None  # routing runs in Python between the halves
    stack = model_in("fp32").fused_layers.stack
    ids, positions, pool, meta = decode_step(1)
    x, cos = torch.zeros(1, ARCH.hidden_size), torch.zeros(1, ARCH.head_dim)
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        stack.run(x, cos, cos, cos, cos, pool[:2], meta.slot_mapping, [], [], BLOCK)


def test_applies_only_to_small_decode_only_steps():
    _, _, _, meta = decode_step(4)
    limit = model_in("fp32").fused_layers.max_rows
    assert limit == PACKED_MIN_ROWS
    assert fused_decode.applies(meta, 4, limit)
    assert not fused_decode.applies(meta, 5, limit)  # rows that are not decodes
    big = dataclasses.replace(meta, num_decodes=PACKED_MIN_ROWS + 1)
    assert not fused_decode.applies(big, PACKED_MIN_ROWS + 1, limit)  # the module path switches to oneDNN there
    mixed = dataclasses.replace(meta, prefills=[PrefillSeq(4, 3, 3, None)])
    assert not fused_decode.applies(mixed, 4, limit)


@pytest.mark.parametrize("mode,limit", [("int4-bf16", None), ("bf16", packed_min_rows(torch.bfloat16)),
                                        ("int4", INT4_DEQUANT_MIN_ROWS), ("int4-a8", None),
                                        ("int8", None), ("int8-bf16", None), ("fp32", PACKED_MIN_ROWS)])
def test_fused_layers_take_as_many_rows_as_the_module_path_runs_their_kernels_for(mode, limit):
    """int4 in lane layout, int8 rows and int4 on int8 activations run the same kernel at every row
    count on the module path, so the fused layers take decode steps of any size there; fp32 models'
    int4 projections run it up to INT4_DEQUANT_MIN_ROWS rows; the others stop where oneDNN takes over."""
    model = model_in(mode)
    if mode == "int4-bf16" and not any(type(m) is Int4LaneLinear for m in model.modules()):
        limit = packed_min_rows(torch.bfloat16)  # a build without bf16 dot products keeps Int4CpuLinear
    assert model.fused_layers.max_rows == limit
    _, _, _, meta = decode_step(4)
    many = dataclasses.replace(meta, num_decodes=100)
    assert fused_decode.applies(many, 100, model.fused_layers.max_rows) == (limit is None or limit >= 100)
    if limit is None or limit > PACKED_MIN_ROWS:
        # above the old 32-row limit, three decode groups, fused: the module path's bits
        pool_dtype = torch.bfloat16 if mode in ("int4-bf16", "int8-bf16") else torch.float32
        assert_fused_step_is_the_module_path(model, 40, pool_dtype)
    assert model_in("int4-bf16", MOE_ARCH).fused_layers.max_rows == packed_min_rows(torch.bfloat16)
    assert model_in("int4", MOE_ARCH).fused_layers.max_rows == PACKED_MIN_ROWS  # MoE experts: their own path


def test_bf16_models_step_fused_up_to_their_own_row_limit():
    _, _, _, meta = decode_step(4)
    limit = model_in("bf16").fused_layers.max_rows
    assert limit == packed_min_rows(torch.bfloat16)
    many = dataclasses.replace(meta, num_decodes=limit)
    assert fused_decode.applies(many, limit, limit)
    assert not fused_decode.applies(dataclasses.replace(meta, num_decodes=limit + 1), limit + 1, limit)


def test_models_it_cannot_serve_keep_the_module_path():
    model = model_in("fp32")
    assert model.to(torch.float16).gather_fused_layers() is None  # neither fp32 nor bf16
    model = model_in("int8")
    assert model.to(torch.float16).gather_fused_layers() is None  # fp16 models: the module path
    model = model_in("fp32")
    model.layers[1].mlp.down_proj = torch.nn.Identity()  # an unknown projection type
    assert model.gather_fused_layers() is None
    odd_heads = LlamaModel(dataclasses.replace(ARCH, head_dim=24, hidden_size=192), max_positions=64)
    assert odd_heads.gather_fused_layers() is None  # head_dim the paged kernel does not take


@pytest.mark.parametrize("arch,mode", [(ARCH, "int8"), (GEMMA2_ARCH, "fp32")])
def test_decode_profile_counts_every_op_of_every_layer_and_leaves_the_bits_alone(arch, mode):
    model = model_in(mode, arch)
    ids, positions, pool, meta = decode_step(5, model.embed_tokens.dtype)
    profiled_pool = [p.clone() for p in pool]
    with torch.inference_mode():
        plain = model(ids, positions, pool, meta)
        model(ids, positions, [p.clone() for p in pool], meta)  # no profile running: not counted below
        with decode_profile() as ops:
            profiled = model(ids, positions, profiled_pool, meta)
            assert ops == {}  # filled when the block exits
    assert torch.equal(plain, profiled)
    assert all(torch.equal(a, b) for a, b in zip(pool, profiled_pool, strict=True))
    sandwich = 2 if arch.sandwich_norms else 0
    expected = {"input_norm": 1, "qkv": 1, "qk_norm": 0, "rope": 1, "kv_write": 1, "attention": 1, "o": 1,
                "post_norm": 1, "gate_up": 1, "activation": 1, "down": 1, "sandwich_norms": sandwich,
                "residual": 1, "layer": 1}
    assert {name: t.calls for name, t in ops.items()} == {n: c * arch.num_layers for n, c in expected.items()}
    assert all(t.seconds > 0 for t in ops.values() if t.calls)
    assert ops["layer"].seconds >= sum(t.seconds for n, t in ops.items() if n != "layer")


def test_decode_profile_without_the_kernel_library_is_a_clear_error(monkeypatch):
    from kiln.errors import KilnError
    from kiln.llm.kernels import ops

    monkeypatch.setattr(ops, "kernels_loaded", lambda: False)
    with pytest.raises(KilnError, match="kernel library is not loaded"), ops.decode_profile():
        pass
