"""Weight-only quantized linear kernels on SmolLM2 shapes, against bf16.

Streams every projection of a 30-layer SmolLM2-sized model plus its LM head
(distinct random weights, far beyond cache) for M rows through each kernel,
the kernels interleaved so machine noise hits them alike:

    bf16        F.linear with bf16 weights and activations (torch)
    bf16-kiln   Kiln's linear_bf16 (AVX512_BF16 dot products where built)
    int8        Kiln's linear_w8 as routed in this build (see ops.linear_w8)
    int8-fp32x  Kiln's weight-only int8 kernel: int8 rows widened, fp32 activations
    int8-vnni   Kiln's linear_w8a8 (avx512_vnni, avx512_bf16 builds): activations quantized
                in groups of 32 to int8, AVX512_VNNI dot products
    int4        Kiln's linear_w4: int4 groups of 32, fp16 scale/min, fp32 activations
    int4-bf16   Kiln's linear_w4_bf16 (avx512_bf16 build): the same weights widened
                to bf16 in registers (tiles above 8 rows), bf16 activations, as a
                bf16 model's kept int4 projections ran until 2026-12-04
    int4-lanes  Kiln's linear_w4l_bf16 (avx512_bf16 build): the same weights in
                lane layout (Int4LaneLinear), bf16 activations, as a finished
                bf16 model's kept int4 projections run
    int4-a8     Kiln's linear_w4a8: the same weights, activations quantized per
                row to int8 in groups of 32, AVX2 integer dot products
    int4-torch  torch's _weight_int4pack_mm_for_cpu (bf16 activations)

Prints ms per full pass, GB/s of the bytes each format stores, and the
speed-up over bf16 (the ratio the quantization targets are stated in).

    .venv/bin/python bench/linear_quant.py [--threads 1] [--repeats 5] [--rows 1 4 16 64 256] [--cpu-time]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.llm.kernels import ops
from kiln.llm.kernels.ops import kernels_loaded
from kiln.llm.quant.int4 import Int4Linear
from kiln.llm.quant.int4_cpu import Int4CpuLinear
from kiln.llm.quant.int4_lanes import Int4LaneLinear
from kiln.llm.quant.int8 import Int8Linear

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out), fused projections
NUM_LAYERS = 30
LM_HEAD = (576, 49152)
GROUP = 32


def float_weights() -> list[torch.Tensor]:
    ws = [torch.randn(n, k) * 0.05 for _ in range(NUM_LAYERS) for k, n in LAYER_SHAPES]
    return ws + [torch.randn(LM_HEAD[1], LM_HEAD[0]) * 0.05]


def nbytes(module_or_tensor) -> int:
    if isinstance(module_or_tensor, torch.Tensor):
        return module_or_tensor.numel() * module_or_tensor.element_size()
    # Int8Linear keeps a bf16 copy of its scales for torch's kernel: count what linear_w8 reads.
    skip = {"scales"} if isinstance(module_or_tensor, Int8Linear) else set()
    return sum(b.numel() * b.element_size() for n, b in module_or_tensor.named_buffers() if n not in skip)


def formats(ws: list[torch.Tensor]) -> dict[str, tuple[list, callable, torch.dtype]]:
    """name -> (per-layer operands, op(x, operand), activation dtype)."""
    int4_torch = [Int4Linear.from_float(w, GROUP) for w in ws]
    bf16 = [w.bfloat16() for w in ws]
    int8 = [Int8Linear.from_float(w) for w in ws]
    int4 = [Int4CpuLinear.from_float(w, GROUP) for w in ws]
    found = {
        "bf16": (bf16, F.linear, torch.bfloat16),
        "bf16-kiln": (bf16, torch.ops.kiln.linear_bf16, torch.bfloat16),
        "int8": (int8, lambda x, m: ops.linear_w8(x, m.weight_int8, m.scales_f32), torch.float32),
        "int8-fp32x": (int8, lambda x, m: torch.ops.kiln.linear_w8_fp32x(x, m.weight_int8, m.scales_f32),
                       torch.float32),
        "int4": (int4, lambda x, m: torch.ops.kiln.linear_w4(x, m.codes, m.scale_min, GROUP), torch.float32),
        "int4-a8": (int4, lambda x, m: torch.ops.kiln.linear_w4a8(x, m.codes, m.scale_min, GROUP), torch.float32),
        "int4-torch": (int4_torch, lambda x, m: m(x), torch.bfloat16),
    }
    if ops.bf16_dot_products():
        found["int4-bf16"] = (int4, lambda x, m: torch.ops.kiln.linear_w4_bf16(x, m.codes, m.scale_min, GROUP),
                              torch.bfloat16)
        lanes = [Int4LaneLinear.from_int4_cpu(m) for m in int4]
        found["int4-lanes"] = (lanes, lambda x, m: torch.ops.kiln.linear_w4l_bf16(x, m.lanes, m.params, GROUP),
                               torch.bfloat16)
    if ops.vnni_int8():
        found["int8-vnni"] = (int8, lambda x, m: torch.ops.kiln.linear_w8a8(x, m.weight_int8, m.scales_f32),
                              torch.float32)
    return found


def one_pass(operands: list, op, rows: int, dtype: torch.dtype, clock) -> float:
    xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
    started = clock()
    for w in operands:
        op(xs[w.in_features if hasattr(w, "in_features") else w.shape[1]], w)
    return clock() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--only", default="", help="comma-separated formats (default: all)")
    ap.add_argument("--cpu-time", action="store_true", help="the process's CPU time, not the wall clock "
                    "(with --threads 1: steadier on a shared box)")
    args = ap.parse_args()
    if not kernels_loaded():
        raise SystemExit("kernels not built: run `python -m kiln.llm.kernels.build`")
    torch.set_num_threads(args.threads)
    fmts = formats(float_weights())
    if args.only:
        fmts = {n: fmts[n] for n in args.only.split(",")}
    clock = time.process_time if args.cpu_time else time.perf_counter
    sizes = {name: sum(nbytes(w) for w in operands) for name, (operands, _, _) in fmts.items()}
    base = "bf16" if "bf16" in fmts else next(iter(fmts))
    print("bytes per pass: " + ", ".join(f"{n} {b / 1e6:.0f} MB" for n, b in sizes.items()))
    results = []
    for rows in args.rows:
        times = {name: [] for name in fmts}
        for _ in range(args.repeats):
            for name, (operands, op, dtype) in fmts.items():
                times[name].append(one_pass(operands, op, rows, dtype, clock))
        med = {name: statistics.median(t) for name, t in times.items()}
        results.append({"rows": rows, **{f"{n}_ms": med[n] * 1e3 for n in fmts},
                        **{f"{n}_gbps": sizes[n] / med[n] / 1e9 for n in fmts}})
        print(f"M={rows:4d}  " + "   ".join(
            f"{n} {med[n] * 1e3:7.1f} ms ({sizes[n] / med[n] / 1e9:4.1f} GB/s, {med[base] / med[n]:4.2f}x {base})"
            for n in fmts))
    out = Path(f"bench/results/linear_quant_t{args.threads}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "bytes": sizes, "results": results}, indent=1))


if __name__ == "__main__":
    main()
