import pytest

from trtopt.runtime.block_pool import BlockPool, hash_block


def test_blocks_are_handed_out_in_order_and_never_the_null_block():
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4
    assert pool.get_new_blocks(2) == [1, 2]
    assert pool.get_new_blocks(2) == [3, 4]
    assert pool.get_new_blocks(1) is None  # back-pressure, not an error
    pool.free_blocks([4, 3])  # uncached blocks go to the front of the queue, so the last freed is reused first
    assert pool.get_new_blocks(2) == [3, 4]
    pool.check_invariants()


def test_get_new_blocks_is_all_or_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.get_new_blocks(2)
    assert pool.get_new_blocks(2) is None
    assert pool.num_free_blocks == 1


def test_double_free_is_caught():
    pool = BlockPool(num_blocks=3, block_size=4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b])


def test_cached_block_survives_free_and_is_revived_by_touch():
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.get_new_blocks(2)
    h = hash_block(None, [5, 6])
    pool.cache_block(a, h)
    pool.free_blocks([b, a])
    assert pool.lookup(h) == a and pool.num_free_blocks == 3
    pool.touch([a])
    assert pool.ref_cnt[a] == 1 and not pool.is_free(a) and pool.num_free_blocks == 2
    pool.check_invariants()


def test_eviction_order_uncached_first_then_least_recently_freed():
    pool = BlockPool(num_blocks=6, block_size=2)
    blocks = pool.get_new_blocks(5)  # [1, 2, 3, 4, 5]
    hashes = {b: hash_block(None, [b, b]) for b in (1, 2, 3)}
    for b, h in hashes.items():
        pool.cache_block(b, h)
    pool.free_blocks([2])  # cached, freed first
    pool.free_blocks([4])  # uncached: goes to the front, reused before any cached block
    pool.free_blocks([1])  # cached, freed second
    assert pool.get_new_blocks(1) == [4]
    assert pool.num_evictions == 0
    assert pool.get_new_blocks(1) == [2]  # least recently freed cached block goes first
    assert pool.lookup(hashes[2]) is None and pool.lookup(hashes[1]) == 1
    assert pool.num_evictions == 1
    assert blocks == [1, 2, 3, 4, 5]
    pool.check_invariants()


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.get_new_blocks(2)
    h = hash_block(None, [1, 2])
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.lookup(h) == a and pool.block_hash[b] is None


def test_hash_chains_on_the_parent():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(None, [3, 4])
    assert hash_block(h1, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])


def test_prefix_cache_off_caches_nothing():
    pool = BlockPool(num_blocks=3, block_size=2, enable_prefix_cache=False)
    (a,) = pool.get_new_blocks(1)
    h = hash_block(None, [1, 2])
    pool.cache_block(a, h)
    assert pool.lookup(h) is None
