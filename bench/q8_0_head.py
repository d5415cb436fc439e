"""The GGUF Q8_0 LM head's kernel against the float head it is bit-identical to.

Per row count: kiln::linear_q8_0 on int8 codes with one scale per 32 weights,
kiln::linear_f32 on the dequantized fp32 weight, and oneDNN on its packed copy
(the three paths Q8_0Head and `project` choose between), on SmolLM2's head
shape (49152 x 576, random codes). Re-tunes Q8_0_HEAD_MAX_ROWS
(kiln/llm/kernels/tuning.py): the largest row count where linear_q8_0 wins.

    .venv/bin/python bench/q8_0_head.py [--threads 2] [--rows 1 4 8 9 16 32] [--repeats 7]
"""
from __future__ import annotations

import argparse

import torch
from int4_prefill import timed  # bench/ is the script's directory: on sys.path

from kiln.llm.kernels import ops

HEAD = (49152, 576)


def median_ms(fn, repeats: int) -> float:
    return timed(fn, repeats) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 9, 16, 24, 32])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if not ops.kernels_loaded():
        raise SystemExit("kernels not built: run `python -m kiln.llm.kernels.build`")
    torch.set_num_threads(args.threads)
    n, k = HEAD
    codes = torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    scales = torch.rand(n, k // 32) * 0.01
    weight = (codes.float().view(n, k // 32, 32) * scales.unsqueeze(-1)).view(n, k).contiguous()
    packed = ops.pack_linear_weight(weight)
    if packed is None:
        raise SystemExit("oneDNN unavailable in this torch build")
    for rows in args.rows:
        x = torch.randn(rows, k)
        q8 = median_ms(lambda x=x: ops.linear_q8_0(x, codes, scales), args.repeats)
        f32 = median_ms(lambda x=x: ops.linear_f32(x, weight), args.repeats)
        onednn = median_ms(lambda x=x: ops.linear_packed(x, packed), args.repeats)
        print(f"rows {rows:3d}: linear_q8_0 {q8:6.2f} ms   linear_f32 {f32:6.2f} ms   oneDNN packed {onednn:6.2f} ms"
              f"   q8_0 / f32 {q8 / f32:4.2f}x")


if __name__ == "__main__":
    main()
