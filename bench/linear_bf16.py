"""Kiln's bf16 linear kernels vs torch's bf16 F.linear and oneDNN with a
packed bf16 weight, on SmolLM2 shapes (the bf16 crossovers of ops.py).

Streams every projection of a 30-layer SmolLM2-sized model plus its LM head
(distinct bf16 weights, ~268 MB, far beyond cache) for M rows, the kernels
interleaved in one process so machine noise hits all alike. Contenders:
- kiln: `kiln::linear_bf16` as loaded (AVX512_BF16 `vdpbf16ps` in the
  avx512_bf16 build, fp32 arithmetic in the avx2 build), bf16 x;
- kiln-fp32math: `kiln::linear_bf16_widen`, weights widened to fp32 in
  registers, fp32 FMAs (the avx2 build's kernel, in every build);
- kiln-fp32x: `kiln::linear_bf16` fed fp32 activations (rounded to bf16 in
  the kernel), fp32 out: what keeping fp32 activations would cost;
- torch: F.linear in bf16; onednn: `_linear_pointwise` on the packed weight;
- with --fp32: Kiln's `linear_f32` on fp32 copies of the weights (twice the bytes).
Prints ms per full pass and effective weight-read GB/s; the crossovers set
BF16_LINEAR_MAX_ROWS and BF16_PACKED_MIN_ROWS in kiln/llm/kernels/tuning.py.

    .venv/bin/python bench/linear_bf16.py [--threads 1] [--repeats 5] [--rows 1 8 32 ...] [--fp32]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.llm.kernels import isa
from kiln.llm.kernels.ops import kernels_loaded, linear_packed, loaded_library, pack_linear_weight

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of SmolLM2-135M's fused projections
NUM_LAYERS = 30
LM_HEAD = (576, 49152)


def weights() -> list[torch.Tensor]:
    ws = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(NUM_LAYERS) for k, n in LAYER_SHAPES]
    return ws + [torch.randn(LM_HEAD[1], LM_HEAD[0], dtype=torch.bfloat16)]


def one_pass(ws: list[torch.Tensor], xs: dict[int, torch.Tensor], op, clock=time.perf_counter) -> float:
    started = clock()
    for w in ws:
        op(xs[w.shape[1]], w)
    return clock() - started


def contenders(ws: list[torch.Tensor], with_fp32: bool) -> dict[str, tuple[object, torch.dtype]]:
    """name -> (op(x, w), dtype of x)."""
    ops: dict[str, tuple[object, torch.dtype]] = {
        "kiln": (torch.ops.kiln.linear_bf16, torch.bfloat16),
        "kiln-fp32math": (torch.ops.kiln.linear_bf16_widen, torch.bfloat16),
        "kiln-fp32x": (torch.ops.kiln.linear_bf16, torch.float32),
        "torch": (F.linear, torch.bfloat16),
    }
    packed = {id(w): pack_linear_weight(w) for w in ws}
    if all(p is not None for p in packed.values()):
        ops["onednn"] = (lambda x, w: linear_packed(x, packed[id(w)]), torch.bfloat16)
    if with_fp32:
        fp32 = {id(w): w.float() for w in ws}
        ops["kiln-f32weights"] = (lambda x, w: torch.ops.kiln.linear_f32(x, fp32[id(w)]), torch.float32)
    return ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64, 128, 256])
    ap.add_argument("--fp32", action="store_true", help="also time Kiln's fp32 kernel on fp32 weights")
    ap.add_argument("--only", default="", help="comma-separated contenders (default: all)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time, not the wall clock (with --threads 1: steadier on a "
                         "shared box, as time other processes take is not counted)")
    args = ap.parse_args()
    if not kernels_loaded():
        raise SystemExit("kernels not built: run `python -m kiln.llm.kernels.build`")
    torch.set_num_threads(args.threads)
    print(f"{isa.cpu_isa().describe()}; loaded build {loaded_library()}; {args.threads} threads")
    ws = weights()
    nbytes = sum(w.numel() * 2 for w in ws)
    ops = contenders(ws, args.fp32)
    if args.only:
        ops = {n: ops[n] for n in args.only.split(",")}
    clock = time.process_time if args.cpu_time else time.perf_counter
    results = []
    for rows in args.rows:
        xs = {dtype: {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] for w in ws}}
              for dtype in (torch.float32, torch.bfloat16)}
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(args.repeats):
            for name, (op, dtype) in ops.items():
                times[name].append(one_pass(ws, xs[dtype], op, clock))
        med = {name: statistics.median(t) for name, t in times.items()}
        best = min(med, key=med.__getitem__)
        results.append({"rows": rows, "best": best, **{f"{n}_ms": med[n] * 1e3 for n in ops}})
        print(f"M={rows:4d}  " + "  ".join(
            f"{n} {med[n] * 1e3:6.1f} ms ({nbytes / med[n] / 1e9:4.1f} GB/s)" for n in ops) + f"  best: {best}")
    out = Path(f"bench/results/linear_bf16_t{args.threads}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "library": loaded_library(), "bf16_weight_bytes": nbytes,
                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
