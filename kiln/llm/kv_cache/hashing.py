"""Chained block hashes for automatic prefix caching.

A full block's hash covers its own token ids and, through the parent hash,
every token before it: two requests share a block only if they share the
entire prefix up to and including that block, and the same cache salt (the
root of the chain; a tenant's salt keeps its prompts out of other tenants'
cache hits, so a hit's timing cannot tell one tenant what another sent).
"""
from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes
ROOT_HASH: BlockHash = b"kiln-prefix-root"


def root_hash(cache_salt: str | None) -> BlockHash:
    """The chain's root: unsalted requests share one; each salt has its own."""
    if cache_salt is None:
        return ROOT_HASH
    return hashlib.sha256(ROOT_HASH + b"/salt/" + cache_salt.encode()).digest()


def hash_block(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def hash_full_blocks(
    token_ids: list[int], block_size: int, known: list[BlockHash], root: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Extend `known` (hashes of the leading full blocks, chained from `root`)
    to every full block of `token_ids`. Returns the extended list (same object)."""
    parent = known[-1] if known else root
    for start in range(len(known) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        known.append(parent)
    return known
