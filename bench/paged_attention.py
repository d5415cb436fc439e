"""Kiln's paged decode-attention kernel alone: ms per layer and KV GB/s.

SmolLM2's attention shape (3 kv heads, 3 query heads each, head_dim 64,
16-token blocks) at B sequences of `--context` tokens, blocks scattered at
random over the pool (the worst case for hardware prefetch) or laid out in
order (`--contiguous`). Bytes = the keys and values the batch reads.

    .venv/bin/python bench/paged_attention.py [--batch 64] [--context 320] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln.llm.kernels.ops import kernels_loaded, paged_decode_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--contiguous", action="store_true")
    args = ap.parse_args()
    if not kernels_loaded():
        raise SystemExit("kernels not built: run `python -m kiln.llm.kernels.build`")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch, ctx, kv_heads, group, head_dim, block = args.batch, args.context, 3, 3, 64, 16
    blocks_per_seq = -(-ctx // block)
    pool_blocks = batch * blocks_per_seq + 64
    k = torch.randn(pool_blocks * block, kv_heads, head_dim)
    v = torch.randn_like(k)
    order = torch.arange(pool_blocks) if args.contiguous else torch.randperm(pool_blocks)
    tables = order[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.long)
    q = torch.randn(batch, kv_heads * group, head_dim)
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        paged_decode_attention(q, k, v, tables, lens, block)
        times.append(time.perf_counter() - started)
    t = statistics.median(times)
    nbytes = 2 * batch * ctx * kv_heads * head_dim * 4
    print(f"batch {batch} context {ctx} threads {args.threads} {'contiguous' if args.contiguous else 'scattered'}: "
          f"{t * 1e3:.2f} ms per layer, {nbytes / t / 1e9:.1f} GB/s of K/V, x30 layers {t * 30e3:.0f} ms")


if __name__ == "__main__":
    main()
