"""Kiln's paged decode-attention kernel alone: ms per step and KV GB/s.

SmolLM2's attention shape (3 kv heads, 3 query heads each, head_dim 64,
16-token blocks) at B sequences of `--context` tokens, over `--layers`
separate pools as in a real step (30 layers: the pools do not fit in L3),
blocks scattered at random over each pool (as after a while of serving) or
laid out in order (`--contiguous`). Each `--pool-dtypes` entry is timed in
turn, repeat after repeat, so slow phases of a shared machine hit all of
them. Bytes = the keys and values the batch reads. `--q-dtype bfloat16`
gives the queries of a bf16 model (widened in the kernel, output rounded).

    .venv/bin/python bench/paged_attention.py [--batch 64] [--context 320] [--threads 2] \
        [--pool-dtypes float32,float16,bfloat16] [--q-dtype float32]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import kiln  # noqa: F401  (before torch allocates: huge pages, as in the server)
from kiln.llm.kernels.ops import kernels_loaded, paged_decode_attention

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--contiguous", action="store_true")
    ap.add_argument("--pool-dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--q-dtype", default="float32", choices=sorted(DTYPES))
    args = ap.parse_args()
    if not kernels_loaded():
        raise SystemExit("kernels not built: run `python -m kiln.llm.kernels.build`")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch, ctx, kv_heads, group, head_dim, block = args.batch, args.context, 3, 3, 64, 16
    blocks_per_seq = -(-ctx // block)
    pool_blocks = batch * blocks_per_seq + 64

    def layer(dtype: torch.dtype):
        k = torch.randn(pool_blocks * block, kv_heads, head_dim).to(dtype)
        order = torch.arange(pool_blocks) if args.contiguous else torch.randperm(pool_blocks)
        return k, torch.randn_like(k), order[: batch * blocks_per_seq].view(batch, blocks_per_seq)

    pools = {name: [layer(DTYPES[name]) for _ in range(args.layers)] for name in args.pool_dtypes.split(",")}
    lens = torch.full((batch,), ctx, dtype=torch.long)
    q = torch.randn(batch, kv_heads * group, head_dim).to(DTYPES[args.q_dtype])
    times: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(args.repeats):
        for name, layers in pools.items():
            started = time.perf_counter()
            for k, v, tables in layers:
                paged_decode_attention(q, k, v, tables, lens, block)
            times[name].append(time.perf_counter() - started)
    layout = "contiguous" if args.contiguous else "scattered"
    for name, ts in times.items():
        t = statistics.median(ts)
        nbytes = 2 * batch * ctx * kv_heads * head_dim * torch.finfo(DTYPES[name]).bits // 8 * args.layers
        print(f"{name} pool, {args.q_dtype} q, batch {batch} context {ctx} threads {args.threads} {layout}, "
              f"{args.layers} layers: median {t * 1e3:.1f} ms (min {min(ts) * 1e3:.1f}), "
              f"{nbytes / t / 1e9:.1f} GB/s of K/V")


if __name__ == "__main__":
    main()
