"""Loads the kernel library once and exposes its ops, or None when absent.

Which library: the build for the CPU's ISA level (isa.py; `KILN_ISA` forces a
lower one), else the best lower build that exists. Absent means Kiln was
installed without a compiler or on a CPU without AVX2/FMA; callers then use
PyTorch's kernels (same results within float rounding). `KILN_KERNELS=0` in
the environment turns them off (A/B runs).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kiln.errors import KilnError
from kiln.llm.kernels import isa
from kiln.llm.kernels.build import BUILDS, LEGACY_LIBRARY, build_on_first_use, find_library
from kiln.llm.kernels.tuning import BF16_LINEAR_MAX_ROWS, BF16_PACKED_MIN_ROWS, LINEAR_MAX_ROWS, PACKED_MIN_ROWS

log = logging.getLogger(__name__)


def packed_min_rows(dtype: torch.dtype) -> int:
    """Above this many rows a projection with a oneDNN-packed weight takes it."""
    return BF16_PACKED_MIN_ROWS if dtype == torch.bfloat16 else PACKED_MIN_ROWS


def _builds_to_try(choice: isa.IsaChoice) -> list[str]:
    """The level's build first, then every lower build."""
    if choice.library is None:
        return []
    ceiling = isa.rank(choice.library)
    return sorted((b for b in BUILDS if isa.rank(b) <= ceiling), key=isa.rank, reverse=True)


@functools.cache
def loaded_library() -> str | None:
    """Name of the build loaded in this process ("avx2", "avx512_bf16"), or
    None when Kiln's kernels are off or absent. Only one build can be loaded
    per process (they register the same ops); decided on first use."""
    if os.environ.get("KILN_KERNELS", "1") == "0":
        return None
    choice = isa.cpu_isa()
    for name in _builds_to_try(choice):
        path = find_library(name) or build_on_first_use(name)
        if path is None:
            continue
        try:
            torch.ops.load_library(str(path))
        except OSError as e:  # built against another torch: rebuild with `make`
            log.warning("kiln kernels: %s not loaded (%s)", path.name, e)
            continue
        log.info("kiln kernels: loaded %s for ISA level %s", path.name, choice.level)
        return name
    hint = f" ({LEGACY_LIBRARY.name} is from an older build: run `make`)" if LEGACY_LIBRARY.exists() else ""
    log.info("kiln kernels: no build loaded for ISA level %s; using PyTorch kernels%s", choice.level, hint)
    return None


def kernels_loaded() -> bool:
    return loaded_library() is not None


def bf16_dot_products() -> bool:
    """Whether linear_bf16 runs on AVX512_BF16 dot products (else fp32 arithmetic)."""
    return loaded_library() == "avx512_bf16"


def vnni_int8() -> bool:
    """Whether the loaded build has the AVX512_VNNI int8 kernel (`linear_w8a8`)."""
    return loaded_library() in ("avx512_vnni", "avx512_bf16")


def linear_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K]^T with Kiln's fp32 kernel, or None when it does
    not apply (library absent, not fp32 CPU, or too many rows)."""
    if (
        x.dim() != 2
        or x.shape[0] > LINEAR_MAX_ROWS
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or not weight.is_contiguous()
        or not kernels_loaded()
    ):
        return None
    return torch.ops.kiln.linear_f32(x, weight)


def linear_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] bf16 @ weight[N, K] bf16 ^T -> bf16 with Kiln's bf16 kernel
    (AVX512_BF16 dot products, or fp32 arithmetic in the AVX2 build), or
    None when it does not apply (library absent, not bf16 CPU, too many rows)."""
    if (
        x.dim() != 2
        or x.shape[0] > BF16_LINEAR_MAX_ROWS
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or not weight.is_contiguous()
        or not kernels_loaded()
    ):
        return None
    return torch.ops.kiln.linear_bf16(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight^T with Kiln's kernel for the operands' dtype (fp32 or
    bf16), or None when none applies."""
    if x.dtype == torch.bfloat16:
        return linear_bf16(x, weight)
    return linear_f32(x, weight)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of an fp32 or bf16 CPU weight [N, K] (an extra
    copy, the size of the weight), or None where oneDNN is unavailable."""
    if (weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu"
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except (AttributeError, RuntimeError):  # a torch build without the op
        return None


def linear_packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T with W as packed by pack_linear_weight (x in W's dtype).
    Each row's result does not depend on M (checked in tests/unit/llm/kernels)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def copies_in_lanes() -> bool:
    """The form of the bf16 weight copies kept for steps of many rows on this
    CPU: Kiln's lane layout (linear_bf16_lanes) where the loaded build has bf16
    dot products and the CPU no AMX, else oneDNN-packed (oneDNN multiplies on
    AMX tiles). Follows KILN_ISA."""
    return bf16_dot_products() and not isa.cpu_isa().at_least("amx")


def bf16_lanes_copy(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weights [N, K] (N % 16 == 0, K even) -> [N/16, K/2, 16, 2]: block r,
    pair c, lane j holds (w[16r + j, 2c], w[16r + j, 2c + 1]) (linear_bf16_lanes' layout)."""
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def copy_for_many_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """A copy of a CPU weight [N, K] for steps of many rows (`linear_copy`): a
    bf16 one in lane layout where `copies_in_lanes` and the shape takes it, else
    oneDNN-packed (None where oneDNN is unavailable)."""
    n, k = weight.shape
    lanes_fit = weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 16 == 0 and k % 2 == 0
    return bf16_lanes_copy(weight) if lanes_fit and copies_in_lanes() else pack_linear_weight(weight)


def linear_copy(x: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T with W's `copy_for_many_rows` copy (x in its dtype); each row's
    result does not depend on M in either form."""
    if copy.dim() == 4:  # lane layout
        y = linear_bf16_lanes(x, copy)
        if y is None:
            raise KilnError("a bf16 weight copy in lane layout needs the kernel build with bf16 dot products")
        return y
    return linear_packed(x, copy)


def _weight_only_applies(
    x: torch.Tensor, weight: torch.Tensor, weight_dtype: torch.dtype, params: torch.Tensor, params_dtype: torch.dtype
) -> bool:
    """fp32 CPU activations [M, K], contiguous quantized weights of the kernel's dtypes, library loaded."""
    return (
        x.dim() == 2
        and x.dtype == torch.float32
        and weight.dtype == weight_dtype
        and params.dtype == params_dtype
        and x.device.type == "cpu"
        and weight.is_contiguous()
        and kernels_loaded()
    )


def linear_w8(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] fp32 @ (weight int8 [N, K] * scales fp32 [N])^T with Kiln's
    kernel (any M), or None when it does not apply. The avx512_vnni and
    avx512_bf16 builds quantize x in groups of 32 to int8 and run AVX512_VNNI
    dot products (`vnni_int8()`); the avx2 and avx512 builds keep x in fp32."""
    if not _weight_only_applies(x, weight, torch.int8, scales, torch.float32):
        return None
    return torch.ops.kiln.linear_w8(x, weight, scales)


def q8_0_lane_panels() -> bool:
    """Whether the loaded build runs linear_q8_0 above 8 rows as lane-major
    outer-product panels (the avx512 and avx512_vnni builds: as fast as
    oneDNN's fp32 GEMM on the float weight from 32 rows, with linear_f32's
    bits at any row count). The avx512_bf16 build compiles its fp32 kernels
    without KILN_AVX512 (eight lanes wide), so not there."""
    return loaded_library() in ("avx512", "avx512_vnni")


def linear_q8_0(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] fp32 @ (codes int8 [N, K] * scales fp32 [N, K/32], one per block of 32: GGUF's
    Q8_0)^T, bit-identical to linear_f32 on the dequantized weight, or None where it does not
    apply (not fp32 CPU, library absent; more than LINEAR_MAX_ROWS rows without the lane panels)."""
    if x.dim() != 2 or not _weight_only_applies(x, codes, torch.int8, scales, torch.float32):
        return None
    if x.shape[0] > LINEAR_MAX_ROWS and not q8_0_lane_panels():
        return None
    return torch.ops.kiln.linear_q8_0(x, codes, scales)


def linear_q8_0_bf16(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] bf16 @ (GGUF Q8_0 codes * scales)^T -> bf16, bit-identical to linear_bf16 on the
    dequantized weight rounded to bf16, or None where linear_bf16 would not run bf16 dot products
    (no AVX512_BF16 build, too many rows, not bf16 CPU x) or K is not a multiple of 32."""
    if not (bf16_dot_products() and x.dim() == 2 and x.shape[0] <= BF16_LINEAR_MAX_ROWS
            and x.dtype == torch.bfloat16 and x.device.type == "cpu" and codes.dtype == torch.int8
            and scales.dtype == torch.float32 and codes.shape[1] % 32 == 0):
        return None
    return torch.ops.kiln.linear_q8_0_bf16(x, codes, scales)


def linear_q8_0a8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """linear_q8_0 with x quantized per row to int8 in the weight's blocks of 32 and integer
    dot products (linear_q8_0a8.cpp: llama.cpp's numerics for a Q8_0 tensor), at any row
    count, or None when it does not apply (not fp32 CPU, library absent)."""
    if not _weight_only_applies(x, codes, torch.int8, scales, torch.float32):
        return None
    return torch.ops.kiln.linear_q8_0a8(x, codes, scales)


def linear_w4(x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """x [M, K] fp32 @ int4-group weights^T (codes uint8 [N, K/2], scale_min
    fp16 or fp32 [N, K/G, 2]; layout in linear_f32.cpp's Int4Problem) with
    Kiln's kernel (activations stay fp32, any M), or None when it does not
    apply. `torch.ops.kiln.linear_w4a8` quantizes x to int8 instead (faster;
    not the default, see linear_f32.cpp)."""
    params_dtype = torch.float32 if scale_min.dtype == torch.float32 else torch.float16
    if not _weight_only_applies(x, codes, torch.uint8, scale_min, params_dtype):
        return None
    return torch.ops.kiln.linear_w4(x, codes, scale_min, group_size)


def linear_w4_panels(
    x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor, group_size: int
) -> torch.Tensor | None:
    """x fp32 [M, K] @ int4-group weights^T for prompt-sized M (linear_w4's
    operands): each output one fp32 chain along K, so a row's result depends
    on neither M nor the other rows, but is not linear_w4's (linear_w4_panels.cpp);
    None where it does not apply."""
    params_dtype = torch.float32 if scale_min.dtype == torch.float32 else torch.float16
    if not _weight_only_applies(x, codes, torch.uint8, scale_min, params_dtype):
        return None
    return torch.ops.kiln.linear_w4_panels(x, codes, scale_min, group_size)


def dequantize_w4(
    codes: torch.Tensor, scale_min: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """The [N, K] weight of int4-group codes (linear_w4's layout), widened as
    the kernel widens it (one FMA per weight) in fp32, or that rounded to bf16
    (as `.to(torch.bfloat16)` would) in the same pass; None without the library."""
    if not kernels_loaded() or codes.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    return torch.ops.kiln.dequantize_w4(codes, scale_min, group_size, dtype == torch.bfloat16)


def linear_w4_bf16(
    x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor, group_size: int
) -> torch.Tensor | None:
    """x [M, K] bf16 @ int4-group weights^T -> bf16, by Kiln's bf16 dot-product
    kernel on weight tiles widened to bf16 as it goes (equal to linear_bf16 on
    dequantize_w4(.., bfloat16)), or None where the build has no bf16 dot products."""
    if not (bf16_dot_products() and x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and codes.dtype == torch.uint8 and scale_min.dtype in (torch.float16, torch.float32)):
        return None
    return torch.ops.kiln.linear_w4_bf16(x, codes, scale_min, group_size)


def linear_w4l_bf16(
    x: torch.Tensor, lanes: torch.Tensor, params: torch.Tensor, group_size: int, copy: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x [M, K] bf16 @ int4-group weights in lane layout (quant/int4_lanes.py)^T
    -> bf16, by bf16 dot products on the weights unrounded, or None where the
    build has no bf16 dot products. `copy`: the weights rounded to bf16 in lane
    layout (bf16_lanes_copy), which steps of 16 rows or more take
    instead (linear_w4l_bf16.cpp kLaneCopyMinRows, the fused decode layer's rule too)."""
    if not (bf16_dot_products() and x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and lanes.dtype == torch.int32 and params.dtype in (torch.float16, torch.float32)):
        return None
    return torch.ops.kiln.linear_w4l_bf16(x, lanes, params, group_size, None, copy)


def linear_bf16_lanes(x: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] bf16 @ bf16 weights in lane layout [N/16, K/2, 16, 2]
    (bf16_lanes_copy)^T -> bf16 (linear_bf16_lanes.cpp), or None where
    the build has no bf16 dot products."""
    if not (bf16_dot_products() and x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and lanes.dtype == torch.bfloat16 and lanes.dim() == 4):
        return None
    return torch.ops.kiln.linear_bf16_lanes(x, lanes)


def linear_w4_fp32x(
    x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor, group_size: int
) -> torch.Tensor | None:
    """The float32-activation int4 kernel by its explicit name (what
    linear_w4 runs today), for exactness tests and A/B against linear_w4a8."""
    params_dtype = torch.float32 if scale_min.dtype == torch.float32 else torch.float16
    if not _weight_only_applies(x, codes, torch.uint8, scale_min, params_dtype):
        return None
    return torch.ops.kiln.linear_w4_fp32x(x, codes, scale_min, group_size)


def linear_w4a8(x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """linear_w4 with x quantized per row to int8 in groups of 32 and integer
    dot products (linear_w4a8.cpp), or None when it does not apply."""
    params_dtype = torch.float32 if scale_min.dtype == torch.float32 else torch.float16
    if not _weight_only_applies(x, codes, torch.uint8, scale_min, params_dtype):
        return None
    return torch.ops.kiln.linear_w4a8(x, codes, scale_min, group_size)


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)


def paged_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, block_size: int, scale: float | None = None, window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor | None:
    """Decode attention read in place from the paged pool (q [B, H, D] fp32,
    bf16 or fp16; pools [slots, KVH, D] fp32, fp16 or bf16) -> [B, H, D] in
    q's dtype, or None when the kernel does not apply (library absent, not
    CPU, other dtypes, head_dim not a multiple of 16, or more than 8 query
    heads per kv head). `scale` defaults to head_dim ** -0.5; `window` > 0
    reads only each row's last `window` keys; `softcap` soft-caps the scores."""
    heads, kv_heads, head_dim = q.shape[1], k_pool.shape[1], q.shape[2]
    if (
        q.dtype not in FLOAT_DTYPES
        or k_pool.dtype not in FLOAT_DTYPES
        or q.device.type != "cpu"
        or head_dim % 16
        or heads % kv_heads
        or heads // kv_heads > 8
        or not kernels_loaded()
    ):
        return None
    return torch.ops.kiln.paged_decode_attention(
        q, k_pool, v_pool, block_tables, context_lens, block_size, head_dim**-0.5 if scale is None else scale,
        window, softcap or 0.0,
    )


def prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor | None:
    """Causal attention of a prefill chunk (q [Q, H, D]) over keys/values
    [L, KVH, D] whose last Q rows are the chunk's own, with Kiln's CPU kernel
    (prefill_attention.cpp) -> [Q, H, D] in q's dtype, or None when it does
    not apply (library absent, not CPU, mixed or other dtypes, head_dim not a
    multiple of 16). `window` > 0: each row sees only its last `window` keys;
    `softcap` soft-caps the scores. bf16 operands with `bf16_dot_products()`
    run on bf16 dot products, the softmax weights rounded to bf16 as torch's
    SDPA rounds them; elsewhere the arithmetic is fp32."""
    if (
        q.dtype not in FLOAT_DTYPES
        or keys.dtype != q.dtype
        or values.dtype != q.dtype
        or q.device.type != "cpu"
        or q.shape[2] % 16
        or q.shape[1] % keys.shape[1]
        or not kernels_loaded()
    ):
        return None
    return torch.ops.kiln.prefill_attention(q, keys, values, scale, window, softcap or 0.0)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
    """Rows of k, v [T, KVH, D] into pool slots `slots` (as index_copy_ of
    k.to(pool dtype)) with Kiln's CPU kernel; False when it does not apply
    (library absent, not CPU, a non-float pool) and nothing was written."""
    if (
        k_pool.device.type != "cpu"
        or k_pool.dtype not in FLOAT_DTYPES
        or v_pool.dtype not in FLOAT_DTYPES
        or not kernels_loaded()
    ):
        return False
    torch.ops.kiln.write_kv(k_pool, v_pool, k, v, slots)
    return True


def row_argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """Index of each row's largest value in fp32/bf16 CPU logits [M, V] with Kiln's
    kernel (row_argmax.cpp: argmax(dim=-1)'s answer, the first among equals, a NaN
    counting as largest), or None where it does not apply (library absent, not CPU)."""
    if (logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype not in ELEMENTWISE_DTYPES
            or logits.shape[1] == 0 or not kernels_loaded()):
        return None
    return torch.ops.kiln.row_argmax(logits)


@dataclass(frozen=True)
class OpTime:
    """One op of the fused decode layers, over a decode profile."""
    seconds: float
    calls: int


@contextlib.contextmanager
def decode_profile() -> Iterator[dict[str, OpTime]]:
    """Times every op of the fused decode layers (decode_layer.cpp: input_norm,
    qkv, rope, kv_write, attention, o, post_norm, gate_up, activation, down,
    residual, ... and `layer`, a whole layer of a DecodeStack step) while the
    block runs; the dict it yields is filled when the block exits. Wall time of
    the calling thread; process-wide counters, so one profile at a time.
    Raises KilnError when the kernel library is not loaded."""
    if not kernels_loaded():
        raise KilnError("decode_profile: Kiln's CPU kernel library is not loaded")
    found: dict[str, OpTime] = {}
    torch.ops.kiln.decode_profile_start()
    try:
        yield found
    finally:
        names, totals = torch.ops.kiln.decode_profile_stop()
        found.update({n: OpTime(int(ns) / 1e9, int(c)) for n, (ns, c) in zip(names, totals.tolist(), strict=True)})


def _cuda_layers(x: torch.Tensor):
    """kiln.llm.kernels.triton_layers for a CUDA tensor (Triton installed,
    KILN_KERNELS not 0), else None."""
    if x.device.type != "cuda" or os.environ.get("KILN_KERNELS", "1") == "0":
        return None
    # Imported here: Triton is an optional dependency, needed only on CUDA.
    from kiln.llm.kernels.triton_env import triton_available

    if not triton_available():
        return None
    from kiln.llm.kernels import triton_layers

    return triton_layers


def _one_kernel_dtype(*tensors: torch.Tensor) -> bool:
    """All fp32 or all bf16 CPU tensors (the elementwise kernels' dtypes, both builds), library loaded."""
    return (
        tensors[0].dtype in ELEMENTWISE_DTYPES
        and all(t.dtype == tensors[0].dtype and t.device.type == "cpu" for t in tensors)
        and kernels_loaded()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x [M, K] rows in one call, or None when not fp32/bf16 CPU (or CUDA: Triton)."""
    if x.dim() == 2 and x.stride(-1) == 1 and (gpu := _cuda_layers(x)) is not None:
        return gpu.rms_norm(x, weight, eps)
    if x.dim() != 2 or not _one_kernel_dtype(x, weight):
        return None
    return torch.ops.kiln.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rms_norm(x + residual), x + residual) in one call, or None."""
    if x.dim() == 2 and x.stride(-1) == residual.stride(-1) == 1 and (gpu := _cuda_layers(x)) is not None:
        return gpu.add_rms_norm(x, residual, weight, eps)
    if x.dim() != 2 or not _one_kernel_dtype(x, residual, weight):
        return None
    return torch.ops.kiln.add_rms_norm(x, residual, weight, eps)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate-half RoPE on q [T, H, D] and k [T, KVH, D] in place; False
    (nothing done) when not fp32/bf16 CPU (or CUDA: Triton). On CPU the tables
    may be fp32 or bf16 (a bf16 model's buffers) whatever q's dtype: fp32
    arithmetic either way."""
    if q.stride(-1) == 1 and k.stride(-1) == 1 and (gpu := _cuda_layers(q)) is not None:
        gpu.rotary_(q, k, cos, sin)
        return True
    if (q.stride(-1) != 1 or k.stride(-1) != 1 or not _one_kernel_dtype(q, k)
            or cos.dtype not in ELEMENTWISE_DTYPES or sin.dtype not in ELEMENTWISE_DTYPES):
        return False
    torch.ops.kiln.rotary_(q, k, cos, sin)
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [T, 2I] = gate | up, or None."""
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and (gpu := _cuda_layers(gate_up)) is not None:
        return gpu.silu_mul(gate_up)
    if gate_up.dim() != 2 or not _one_kernel_dtype(gate_up):
        return None
    return torch.ops.kiln.silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gelu_tanh(gate) * up for gate_up [T, 2I] = gate | up (fp32 or bf16 CPU), or None."""
    if gate_up.dim() != 2 or not _one_kernel_dtype(gate_up):
        return None
    return torch.ops.kiln.gelu_tanh_mul(gate_up)
