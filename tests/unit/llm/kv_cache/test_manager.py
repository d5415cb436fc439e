"""Exact block-id tests of the KV cache manager on a dozen-block pool."""
import pytest

from kiln.errors import InvalidRequestError
from kiln.llm.kv_cache.manager import KVCacheManager
from kiln.llm.request import Request
from kiln.llm.sampling_params import SamplingParams

BS = 4


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def admit(kv, r):
    """What the scheduler does on admission: prefix lookup, then allocate."""
    hit = kv.find_prefix(r)
    kv.record_lookup(r, hit)
    assert kv.can_allocate(r, r.num_tokens - hit.num_tokens, hit)
    kv.allocate(r, r.num_tokens - hit.num_tokens, hit)
    r.num_computed_tokens = r.num_tokens
    return hit


@pytest.fixture
def kv():
    return KVCacheManager(num_blocks=12, block_size=BS)


def test_allocation_rounds_up_to_blocks(kv):
    r = req("a", range(10))  # 10 tokens -> 3 blocks
    admit(kv, r)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 9
    # decode: token 11 fits block 2, token 13 needs block 3
    r.output_token_ids.append(100)
    kv.allocate(r, 1)
    r.num_computed_tokens += 1
    assert kv.block_ids("a") == [0, 1, 2]
    r.output_token_ids.append(101)
    kv.allocate(r, 1)
    r.num_computed_tokens += 1
    assert kv.block_ids("a") == [0, 1, 2]
    r.output_token_ids.append(102)
    kv.allocate(r, 1)
    assert kv.block_ids("a") == [0, 1, 2, 3]
    kv.free(r)
    assert kv.num_free_blocks == 12


def test_shared_prefix_reuses_blocks_and_counts_hits(kv):
    a = req("a", range(10))
    admit(kv, a)
    b = req("b", list(range(8)) + [50, 51, 52])  # shares two full blocks
    hit = admit(kv, b)
    assert hit.num_tokens == 8
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert kv.stats.queries == 21 and kv.stats.hits == 8
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 12
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_last_token_is_never_served_from_cache(kv):
    a = req("a", range(8))  # exactly two full blocks
    admit(kv, a)
    kv.free(a)
    b = req("b", range(8))
    hit = admit(kv, b)
    assert hit.num_tokens == 4  # one block held back so its last token is computed
    assert kv.block_ids("b")[0] == 0


def test_released_prefix_survives_and_is_evicted_lru(kv):
    a = req("a", range(12))  # blocks 0,1,2 all full and cached
    admit(kv, a)
    kv.free(a)  # free queue: 3..11, then 2, 1, 0 (tail first)
    filler = req("f", range(100, 136))  # 36 tokens = 9 blocks takes 3..11
    admit(kv, filler)
    assert kv.block_ids("f") == list(range(3, 12))
    c = req("c", range(100, 104))  # needs 1 more block -> evicts block 2 (a's tail) first
    c.prompt_token_ids = [200, 201, 202]
    admit(kv, c)
    assert kv.block_ids("c") == [2]
    kv.free(filler)  # free queue: 1, 0, then filler's blocks tail first: 11, 10, ..., 3
    d = req("d", list(range(8)) + [7, 7])  # a's first two blocks still hit
    hit = admit(kv, d)
    assert hit.num_tokens == 8 and kv.block_ids("d") == [0, 1, 11]

def test_can_allocate_counts_revived_blocks(kv):
    a = req("a", range(8))
    admit(kv, a)
    kv.free(a)
    hog = req("h", range(1000, 1040))  # 10 blocks: all but 0 and 1
    admit(kv, hog)
    assert kv.num_free_blocks == 2
    b = req("b", list(range(8)) + [9])  # hits block 0 and 1 (both free), needs 1 fresh
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 8
    # Reviving 0 and 1 uses both free slots; no room left for the third block.
    assert kv.blocks_needed(b, 1, hit) == 3
    assert not kv.can_allocate(b, 1, hit)


def test_prefix_caching_off_shares_nothing():
    kv = KVCacheManager(num_blocks=12, block_size=BS, enable_prefix_caching=False)
    a, b = req("a", range(8)), req("b", range(9))
    admit(kv, a)
    hit = admit(kv, b)
    assert hit.num_tokens == 0
    assert kv.block_ids("a") == [0, 1] and kv.block_ids("b") == [2, 3, 4]


def salted(rid, tokens, salt):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8, cache_salt=salt))


def test_a_cache_salt_shares_blocks_only_within_its_tenant(kv):
    admit(kv, salted("a", range(10), "tenant-1"))
    assert admit(kv, salted("b", range(10), "tenant-1")).num_tokens == 8  # same tenant: two full blocks hit
    assert admit(kv, salted("c", range(10), "tenant-2")).num_tokens == 0  # other tenant: nothing
    assert admit(kv, req("d", range(10))).num_tokens == 0  # unsalted: nothing either
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert not set(kv.block_ids("c")) & set(kv.block_ids("a"))
    assert not set(kv.block_ids("d")) & (set(kv.block_ids("a")) | set(kv.block_ids("c")))
    assert admit(kv, req("e", range(8))).num_tokens == 4  # unsalted requests still share among themselves


def test_a_cache_salt_must_be_a_short_non_empty_string():
    for bad in ("", "x" * 257, 7):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            SamplingParams(cache_salt=bad)
