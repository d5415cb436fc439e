"""Kiln's fp32 linear kernel vs PyTorch's F.linear (MKL) and oneDNN with a
packed weight, on SmolLM2 shapes.

Streams every projection of a 30-layer SmolLM2-sized model plus its LM head
(distinct weights, ~536 MB fp32, far beyond cache) for M rows, the kernels
interleaved so machine noise hits all alike. Prints ms per full pass,
effective weight-read GB/s and GFLOP/s; the crossovers set LINEAR_MAX_ROWS
(Kiln vs MKL) and PACKED_MIN_ROWS (Kiln vs oneDNN) in kiln/llm/kernels/tuning.py.

    .venv/bin/python bench/linear_f32.py [--threads 1] [--repeats 7] [--rows 1 8 32 ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.llm.kernels.ops import kernels_loaded, linear_packed, pack_linear_weight

# (in, out) of SmolLM2-135M's fused projections; the LM head is 576 -> 49152.
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
NUM_LAYERS = 30
LM_HEAD = (576, 49152)


def weights() -> list[torch.Tensor]:
    ws = [torch.randn(n, k) for _ in range(NUM_LAYERS) for k, n in LAYER_SHAPES]
    return ws + [torch.randn(LM_HEAD[1], LM_HEAD[0])]


def one_pass(ws: list[torch.Tensor], rows: int, op) -> float:
    xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in ws}}
    started = time.perf_counter()
    for w in ws:
        op(xs[w.shape[1]], w)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16, 32, 64, 128, 256, 512, 1024])
    args = ap.parse_args()
    if not kernels_loaded():
        raise SystemExit("kernels not built: run `python -m kiln.llm.kernels.build`")
    torch.set_num_threads(args.threads)
    ws = weights()
    nbytes = sum(w.numel() * 4 for w in ws)
    ops = {"torch": F.linear, "kiln": torch.ops.kiln.linear_f32}
    packed = {id(w): pack_linear_weight(w) for w in ws}
    if all(p is not None for p in packed.values()):
        ops["onednn"] = lambda x, w: linear_packed(x, packed[id(w)])
    results = []
    for rows in args.rows:
        times = {name: [] for name in ops}
        for _ in range(args.repeats):
            for name, op in ops.items():
                times[name].append(one_pass(ws, rows, op))
        med = {name: statistics.median(t) for name, t in times.items()}
        results.append({"rows": rows, **{f"{n}_ms": med[n] * 1e3 for n in ops},
                        **{f"{n}_gbps": nbytes / med[n] / 1e9 for n in ops}})
        flops = 2 * rows * nbytes / 4
        print(f"M={rows:4d}  " + "   ".join(
            f"{n} {med[n] * 1e3:7.1f} ms ({nbytes / med[n] / 1e9:5.1f} GB/s, {flops / med[n] / 1e9:5.1f} GFLOP/s)"
            for n in ops) + f"   kiln / torch {med['torch'] / med['kiln']:.2f}x")
    out = Path(f"bench/results/linear_f32_t{args.threads}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "weight_bytes": nbytes, "results": results}, indent=1))


if __name__ == "__main__":
    main()
