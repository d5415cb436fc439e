"""Kiln's causal prefill attention kernel against torch's SDPA (its CPU flash
attention), one whole-prompt chunk, SmolLM2's heads (9 query heads over 3 kv
heads, head_dim 64) unless told otherwise. Prints ms per call and GFLOP/s
(causal: half the square of scores, 4 * H * D flops per visible key) for
each length and dtype; Kiln and torch take turns call by call, so a noisy
neighbour slows both alike.

    .venv/bin/python bench/prefill_attention.py [--lengths 128,300,512,1024] [--threads 2]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from kiln.llm.kernels.isa import cpu_isa
from kiln.llm.kernels.ops import kernels_loaded, prefill_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        is_causal=True, enable_gqa=True, scale=scale,
    )
    return out.squeeze(0).transpose(0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,300,512,1024")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    if not kernels_loaded():
        raise SystemExit("Kiln's kernels are not loaded (make install, or KILN_KERNELS is 0)")
    torch.set_num_threads(args.threads)
    print(f"ISA level {cpu_isa().level}, {args.threads} threads, heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}")
    scale = args.head_dim**-0.5
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for length in (int(n) for n in args.lengths.split(",")):
            q = torch.randn(length, args.heads, args.head_dim).to(dtype)
            k = torch.randn(length, args.kv_heads, args.head_dim).to(dtype)
            v = torch.randn(length, args.kv_heads, args.head_dim).to(dtype)
            runs = {
                "kiln": functools.partial(prefill_attention, q, k, v, scale),
                "torch": functools.partial(sdpa, q, k, v, scale),
            }
            times: dict[str, list[float]] = {n: [] for n in runs}
            for _ in range(3):
                for run in runs.values():
                    run()
            for _ in range(args.calls):
                for n, run in runs.items():
                    start = time.perf_counter()
                    run()
                    times[n].append(time.perf_counter() - start)
            flops = 4 * args.heads * args.head_dim * length * (length + 1) / 2
            ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
            print(f"{name} L={length}: kiln {ms['kiln']:.2f} ms ({flops / ms['kiln'] / 1e6:.0f} GFLOP/s), "
                  f"torch SDPA {ms['torch']:.2f} ms ({flops / ms['torch'] / 1e6:.0f} GFLOP/s): "
                  f"{ms['torch'] / ms['kiln']:.2f}x")


if __name__ == "__main__":
    main()
