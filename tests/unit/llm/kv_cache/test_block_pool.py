from kiln.llm.kv_cache.block_pool import BlockPool


def test_allocate_takes_lowest_free_ids_in_order():
    pool = BlockPool(12)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    assert [b.block_id for b in pool.allocate(2)] == [3, 4]
    assert pool.num_free == 7


def test_freed_blocks_without_contents_are_reused_first():
    pool = BlockPool(4)
    a = pool.allocate(2)  # 0, 1
    pool.free(list(reversed(a)))  # tail first: 1 then 0
    assert [b.block_id for b in pool.allocate(4)] == [0, 1, 2, 3]


def test_freed_cached_blocks_go_after_never_used_ones_least_recent_first():
    pool = BlockPool(6)
    a = pool.allocate(3)  # 0, 1, 2
    pool.cache(a[0], b"h0")
    pool.cache(a[1], b"h1")
    pool.free(list(reversed(a)))  # 2 (no hash) to the front; 1 then 0 to the back
    assert [b.block_id for b in pool.allocate(6)] == [2, 3, 4, 5, 1, 0]
    assert pool.lookup(b"h0") is None and pool.lookup(b"h1") is None


def test_ref_counts_and_double_free():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b])
    assert b.ref_cnt == 1 and pool.num_free == 1
    pool.free([b])
    assert b.ref_cnt == 0 and pool.num_free == 2
    try:
        pool.free([b])
    except RuntimeError as e:
        assert "freed twice" in str(e)
    else:
        raise AssertionError("double free not detected")


def test_cached_block_revived_by_touch_and_evicted_on_reuse():
    pool = BlockPool(2)
    (b0,) = pool.allocate(1)
    pool.cache(b0, b"h0")
    pool.free([b0])
    assert pool.lookup(b"h0") is b0 and pool.num_free == 2
    pool.touch([b0])  # prefix hit revives it
    assert b0.ref_cnt == 1 and pool.num_free == 1
    pool.free([b0])
    # Free queue is now [1, 0]; taking both evicts block 0's hash.
    assert [b.block_id for b in pool.allocate(2)] == [1, 0]
    assert pool.lookup(b"h0") is None and pool.num_evictions == 1
