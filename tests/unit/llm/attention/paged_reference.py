"""Torch references for the Triton attention tests: random paged pools and
attention computed in float64 from the values the pool holds."""
from __future__ import annotations

import torch

FP8_MAX = 448.0


def random_pool(num_blocks, block_size, kv_heads, head_dim, dtype, generator, scale=1.0):
    """[2, slots, KVH, D] of `dtype`; fp8 pools hold (x / scale) clamped."""
    x = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, generator=generator) * 2
    if dtype == torch.float8_e4m3fn:
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def random_tables(lens, block_size, num_blocks, generator, width=None):
    """Disjoint random blocks for each context; rows padded with block 0."""
    need = [-(-n // block_size) for n in lens]
    width = width or max(max(need), 1)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    assert sum(need) <= num_blocks
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for row, n in enumerate(need):
        tables[row, :n] = torch.tensor(order[used : used + n], dtype=torch.long)
        used += n
    return tables


def gather(pool, table, n, block_size):
    """pool [slots, KVH, D] -> the first n tokens of `table`'s blocks, float64."""
    slots = [int(table[p // block_size]) * block_size + p % block_size for p in range(n)]
    return pool[torch.tensor(slots, dtype=torch.long)].double()


def attend(q, keys, values, visible=None):
    """q [Q, H, D], keys/values [L, KVH, D] -> [Q, H, D] float64 (GQA by repeat)."""
    q = q.double()
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q, keys) / q.shape[-1] ** 0.5
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), values)


def decode_reference(q, pool, tables, lens, block_size, k_scale=1.0, v_scale=1.0):
    rows = []
    for i, n in enumerate(lens):
        keys = gather(pool[0], tables[i], n, block_size) * k_scale
        values = gather(pool[1], tables[i], n, block_size) * v_scale
        rows.append(attend(q[i : i + 1], keys, values)[0])
    return torch.stack(rows)


def prefill_reference(q, k, v, pool, chunks, tables, block_size, k_scale=1.0, v_scale=1.0):
    """chunks: (q_start, q_len, prefix_len) per chunk; the prefix comes from
    the pool (times its scales), the chunk's own keys from k, v; causal."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row, (start, n, prefix) in enumerate(chunks):
        rows = slice(start, start + n)
        keys = torch.cat([gather(pool[0], tables[row], prefix, block_size) * k_scale, k[rows].double()])
        values = torch.cat([gather(pool[1], tables[row], prefix, block_size) * v_scale, v[rows].double()])
        visible = torch.arange(prefix + n)[None, :] <= (prefix + torch.arange(n))[:, None]
        out[rows] = attend(q[rows], keys, values, visible)
    return out
