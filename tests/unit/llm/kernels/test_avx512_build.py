"""The avx512 build (AVX-512 F/BW/VL/DQ without BF16: Skylake-SP to Ice Lake) against the avx2 build, in
fresh processes (a process loads one build for good): its sixteen-lane int4 kernels (linear_w4's narrow
passes and its lane panels above 8 rows, linear_w4_panels for prompts), fp32 and bf16 linears (pairs of weight
rows), activations, prefill attention and decode attention (eight lanes wide in this build, as in the avx2
build: paged_attention.cpp) give the avx2 build's bits. Runs wherever the CPU has
AVX-512 (an AVX512_BF16 or AMX CPU too: KILN_ISA=avx512 forces the build)."""
import io
import os
import subprocess
import sys

import pytest
import torch

from kiln.llm.kernels import isa
from kiln.llm.kernels.build import BUILDS

PROBE = """
import io, sys, torch
from kiln.llm.kernels import ops
assert ops.kernels_loaded()
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
out = {"library": ops.loaded_library()}
# N: whole and partial pair blocks and panels, an odd last row; K = 1536 and 4224 run in K blocks
# (the tiles' blocks of 512; the avx512 panels' blocks of 2048, the last one partial).
for n, k in ((960, 576), (27, 576), (13, 1536), (50, 128), (70, 4224)):
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale_min = ((torch.rand(n, k // 32, 2, generator=g) - 0.5) * 0.1).half()
    for m in (1, 7, 9, 13, 64, 65, 193, 241, 500):  # narrow, tiles with row tails, panels with row tails
        x = torch.randn(m, k, generator=g)
        out[f"linear_w4 {n}x{k} m={m}"] = torch.ops.kiln.linear_w4(x, codes, scale_min, 32)
        if m > 8:
            out[f"linear_w4_panels {n}x{k} m={m}"] = torch.ops.kiln.linear_w4_panels(x, codes, scale_min, 32)
# linear_w4's narrow passes (pairs of weight rows sixteen lanes wide in the avx512 build; a row tail
# eight) at every M <= 8 and its lane panels above (9, 20 rows), with groups that split a run of 64 (32,
# 96) or not (64), fp16 and fp32 parameters.
for n, k in ((27, 576), (13, 1536)):
    for group in (32, 64, 96):
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        params = (torch.rand(n, k // group, 2, generator=g) - 0.5) * 0.1
        for dtype in (torch.float16, torch.float32):
            for m in (*range(1, 9), 9, 20):
                x = torch.randn(m, k, generator=g)
                out[f"linear_w4 {n}x{k} G={group} {dtype} m={m}"] = torch.ops.kiln.linear_w4(
                    x, codes, params.to(dtype), group)
# linear_f32 and linear_bf16 (fp32 arithmetic in both builds; pairs of weight rows sixteen lanes wide in
# the avx512 build): narrow passes, the wide block with row and column tails, a K tail.
for n, k in ((27, 576), (50, 1540)):
    weight = torch.randn(n, k, generator=g)
    for m in (1, 2, 4, 8, 13, 64):
        x = torch.randn(m, k, generator=g)
        out[f"linear_f32 {n}x{k} m={m}"] = torch.ops.kiln.linear_f32(x, weight)
        out[f"linear_bf16 {n}x{k} m={m}"] = torch.ops.kiln.linear_bf16(x, weight.bfloat16())
gate_up = torch.randn(5, 2 * 1549, generator=g) * 6  # sixteen-, eight-lane and scalar parts
out["silu_mul"] = torch.ops.kiln.silu_mul(gate_up)
out["gelu_tanh_mul"] = torch.ops.kiln.gelu_tanh_mul(gate_up)
# Prefill attention: the avx512 build passes over 32 keys and 32 head dims (16 where D is an odd multiple of
# 16), the avx2 build 16 and 16; the same chains. (Q, L, heads, kv heads, D, window, softcap, dtype).
for shape in ((70, 70, 9, 3, 64, 0, 0.0, torch.float32), (40, 150, 8, 2, 80, 0, 0.0, torch.float32),
              (33, 33, 4, 4, 48, 10, 30.0, torch.float32), (50, 90, 6, 2, 64, 0, 0.0, torch.float16)):
    n_q, n_k, heads, kv_heads, dim, window, softcap, dtype = shape
    rows = ((n_q, heads), (n_k, kv_heads), (n_k, kv_heads))
    q, k, v = (torch.randn(n, h, dim, generator=g).to(dtype) for n, h in rows)
    out[f"prefill_attention {shape}"] = torch.ops.kiln.prefill_attention(q, k, v, dim ** -0.5, window, softcap)
block, heads, kv_heads, dim = 16, 9, 3, 64
k_pool = torch.randn(40 * block, kv_heads, dim, generator=g).half()
v_pool = torch.randn(40 * block, kv_heads, dim, generator=g).half()
tables = torch.randperm(40, generator=g)[:36].reshape(4, 9)
lens = torch.tensor([1, 17, 100, 144])
q = torch.randn(4, heads, dim, generator=g)
out["attention"] = ops.paged_decode_attention(q, k_pool, v_pool, tables, lens, block)
# One sequence of 500 keys: split between the threads (attend_split) in both builds, an fp32 pool, bf16 queries.
out["attention split"] = ops.paged_decode_attention(q[2:3].bfloat16(), k_pool.float(), v_pool.float(),
                                                    torch.randperm(40, generator=g)[:32].reshape(1, 32),
                                                    torch.tensor([500]), block)
# The same split on the fp16 pool: pass 2 in 32-dimension slices in the avx512 builds, 16 in the avx2 build.
out["attention split fp16"] = ops.paged_decode_attention(q[1:2], k_pool, v_pool,
                                                         torch.randperm(40, generator=g)[:32].reshape(1, 32),
                                                         torch.tensor([500]), block)
buffer = io.BytesIO()
torch.save(out, buffer)
sys.stdout.buffer.write(buffer.getvalue())
"""


def _outputs(level: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_ISA", "KILN_KERNELS")}
    env["KILN_ISA"] = level
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    return torch.load(io.BytesIO(done.stdout))


def _unavailable() -> bool:
    return (not isa.cpu_isa().at_least("avx512") or isa.cpu_isa().forced
            or not all(BUILDS[name].library.exists() for name in ("avx2", "avx512")))


@pytest.mark.skipif(_unavailable(), reason="needs an AVX-512 CPU, the avx2 and avx512 builds and no KILN_ISA")
def test_the_avx512_build_gives_the_avx2_builds_bits():
    wide, narrow = _outputs("avx512"), _outputs("avx2")
    assert (wide.pop("library"), narrow.pop("library")) == ("avx512", "avx2")
    assert len(wide) == len(narrow) == 5 * (9 + 7) + 2 * 3 * 2 * 10 + 2 * 6 * 2 + 2 + 4 + 3
    for name, values in wide.items():
        assert torch.equal(values.view(torch.uint8), narrow[name].view(torch.uint8)), name


def _bf16_build_unavailable() -> bool:
    return (not isa.cpu_isa().at_least("avx512_bf16") or isa.cpu_isa().forced
            or not all(BUILDS[name].library.exists() for name in ("avx2", "avx512_bf16")))


@pytest.mark.skipif(_bf16_build_unavailable(),
                    reason="needs an AVX512_BF16 CPU, the avx2 and avx512_bf16 builds and no KILN_ISA")
def test_the_avx512_bf16_builds_int4_kernels_give_the_avx2_builds_bits():
    """The avx512_bf16 build's fp32-activation int4 kernels: its one-row passes run pairs of weight rows
    sixteen lanes wide (linear_f32.cpp: KILN_INT4_PAIRS), the rest eight lanes as in the avx2 build."""
    wide, narrow = _outputs("avx512_bf16"), _outputs("avx2")
    assert (wide.pop("library"), narrow.pop("library")) == ("avx512_bf16", "avx2")
    int4 = [name for name in wide if name.startswith("linear_w4")]
    assert len(int4) == 5 * (9 + 7) + 2 * 3 * 2 * 10
    for name in int4:
        assert torch.equal(wide[name].view(torch.uint8), narrow[name].view(torch.uint8)), name
