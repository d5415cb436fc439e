"""Per-request block tables on top of the block pool, with prefix caching.

Knows token ids and block ids only; no tensors. Token position p of a
request lives in block `table[p // block_size]` at offset `p % block_size`.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.llm.kv_cache.block_pool import Block, BlockPool
from kiln.llm.kv_cache.hashing import BlockHash, hash_full_blocks, root_hash
from kiln.llm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixHit:
    blocks: list[Block]
    num_tokens: int


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_published: dict[str, int] = {}  # leading blocks already offered to the cache
        self.stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest run of cached full blocks at the start of the request.

        At least one token is always left uncached, so the step that admits
        the request computes logits for its last token.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        hashes = self._hashes_for(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[Block] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(blocks, len(blocks) * self.block_size)

    def record_lookup(self, request: Request, hit: PrefixHit) -> None:
        self.stats.queries += request.num_tokens
        self.stats.hits += hit.num_tokens

    # ---- check-then-act ------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        """Pool blocks an allocation would consume (revived cache hits included)."""
        have = len(self.tables.get(request.request_id, ())) + (len(hit.blocks) if hit else 0)
        computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        fresh = max(0, cdiv(computed + num_new_tokens, self.block_size) - have)
        revived = sum(1 for b in hit.blocks if b.ref_cnt == 0) if hit else 0
        return fresh + revived

    def can_allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        return self.blocks_needed(request, num_new_tokens, hit) <= self.pool.num_free

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> None:
        """Give the request room for `num_new_tokens` more tokens (after any
        prefix hit) and publish the blocks those tokens complete."""
        if not self.can_allocate(request, num_new_tokens, hit):
            raise RuntimeError(f"cannot allocate for {request.request_id}; call can_allocate first")
        table = self.tables.setdefault(request.request_id, [])
        if hit and hit.blocks:
            self.pool.touch(hit.blocks)
            table.extend(hit.blocks)
        computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        fresh = cdiv(computed + num_new_tokens, self.block_size) - len(table)
        if fresh > 0:
            table.extend(self.pool.allocate(fresh))
        # Draft tokens (speculative decoding) lie past request.num_tokens:
        # only blocks full of verified tokens are ever published.
        self._publish_full_blocks(request, table, min(computed + num_new_tokens, request.num_tokens))

    def rollback(self, request: Request) -> None:
        """Free the tail blocks that hold no token of the request (slots
        allocated for rejected draft tokens). Kept blocks never carry a hash
        over a draft token, since publication stops at `num_tokens`."""
        table = self.tables.get(request.request_id)
        if table is None:
            return
        keep = cdiv(request.num_tokens, self.block_size)
        if len(table) > keep:
            extra = table[keep:]
            del table[keep:]
            self.pool.free(list(reversed(extra)))

    def free(self, request: Request) -> None:
        """Release every block of the request; cached ones stay findable."""
        table = self.tables.pop(request.request_id, [])
        self.pool.free(list(reversed(table)))
        self._hashes.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)

    def discard(self, request: Request) -> None:
        """Free a request whose step failed: blocks only it holds leave the
        prefix cache too, since their keys and values may never have been written."""
        for block in self.tables.get(request.request_id, ()):
            if block.ref_cnt == 1:
                self.pool.uncache(block)
        self.free(request)

    # ---- helpers -------------------------------------------------------
    def _hashes_for(self, request: Request) -> list[BlockHash]:
        known = self._hashes.setdefault(request.request_id, [])
        root = root_hash(request.sampling_params.cache_salt)
        return hash_full_blocks(request.all_token_ids, self.block_size, known, root)

    def _publish_full_blocks(self, request: Request, table: list[Block], num_tokens: int) -> None:
        # Tokens up to num_tokens are known (prompt or already sampled) and
        # their KV is written in this step before any attention reads it, so
        # another request in the same step may already share these blocks.
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes_for(request)
        for i in range(start, num_full):
            self.pool.cache(table[i], hashes[i])
        self._num_published[request.request_id] = num_full
