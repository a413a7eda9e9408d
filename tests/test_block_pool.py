"""BlockPool: reference counts, the free queue's eviction order, and the prefix-cache map."""

from __future__ import annotations

import pytest

from conveyor.core.block_pool import BlockHash, BlockPool, hash_block


def _all_free(pool: BlockPool) -> None:
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)


def test_rejects_an_empty_pool() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_allocate_touch_and_free_count_references() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3
    assert pool.num_free_blocks == 1
    assert [pool.blocks[i].ref_count for i in ids] == [1, 1, 1]
    pool.touch([ids[0]])  # a second owner (a prefix shared by two requests)
    assert pool.blocks[ids[0]].ref_count == 2
    pool.free([ids[0]])
    assert pool.blocks[ids[0]].ref_count == 1
    assert pool.num_free_blocks == 1  # still referenced: not free
    pool.check_integrity()
    pool.free(ids)
    _all_free(pool)


def test_allocating_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    held = pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks with 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity()
    pool.free(held)
    _all_free(pool)


def test_double_free_asserts() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block])
    # the same block twice in one call is a double free too
    [block] = pool.allocate(1)
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block, block])


def test_eviction_order_uncached_first_then_least_recently_freed_cached() -> None:
    pool = BlockPool(5)
    ids = pool.allocate(5)
    assert pool.num_free_blocks == 0
    hashes = {}
    parents: dict[int, int | None] = {}  # block -> the block before it in the sequence
    parent = None
    for n, i in enumerate(ids[:3]):  # three full, registered blocks of one sequence
        parent = hash_block(parent, [i, i, i, i])
        hashes[i] = parent
        parents[i] = ids[n - 1] if n else None
        pool.register(i, parent, parents[i])
    # Free in this order: cached 1, uncached 3, cached 0, uncached 4, cached 2.
    for i in (ids[1], ids[3], ids[0], ids[4], ids[2]):
        pool.free([i])
    pool.check_integrity()
    assert pool.num_free_blocks == 5  # cached-but-idle blocks count as free

    first_two = pool.allocate(2)
    assert set(first_two) == {ids[3], ids[4]}, "uncached blocks must be reused first"
    assert pool.stats.evictions == 0
    for i in ids[:3]:
        assert pool.lookup(hashes[i], parents[i]) == i  # nothing cached was evicted yet

    assert pool.allocate(1) == [ids[1]]  # least recently freed cached block
    assert pool.lookup(hashes[ids[1]], parents[ids[1]]) is None
    assert pool.blocks[ids[1]].block_hash is None
    assert pool.stats.evictions == 1
    assert pool.allocate(1) == [ids[0]]
    assert pool.allocate(1) == [ids[2]]
    assert pool.stats.evictions == 3
    assert all(pool.lookup(h, parents[i]) is None for i, h in hashes.items())
    pool.check_integrity()
    pool.free(ids)
    _all_free(pool)


def test_lookup_hit_and_miss_and_touch_of_an_idle_cached_block() -> None:
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    h = hash_block(None, [1, 2, 3, 4])
    assert pool.lookup(h, None) is None  # not registered yet
    pool.register(block, h, None)
    assert pool.lookup(h, None) == block
    assert pool.lookup(hash_block(None, [1, 2, 3, 5]), None) is None
    assert pool.lookup(hash_block(h, [1, 2, 3, 4]), block) is None  # same tokens, other prefix
    assert pool.lookup(h, block) is None  # same key, but after another parent block
    pool.free([block])
    assert pool.num_free_blocks == 3
    assert pool.lookup(h, None) == block  # idle but still cached
    pool.touch([block])  # a hit takes it out of the free queue
    assert pool.blocks[block].ref_count == 1
    assert pool.num_free_blocks == 2
    assert block not in pool.allocate(2)
    assert pool.num_free_blocks == 0
    pool.check_integrity()
    pool.free([b.block_id for b in pool.blocks])
    _all_free(pool)


def test_forced_hash_collision_is_a_miss_never_a_wrong_hit() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    ha = BlockHash(value=42, token_ids=(1, 2, 3, 4))
    hb = BlockHash(value=42, token_ids=(9, 9, 9, 9))  # same value, other tokens
    pool.register(a, ha, None)
    assert pool.lookup(hb, None) is None
    pool.register(b, hb, None)  # first writer keeps the map entry
    assert pool.lookup(ha, None) == a
    assert pool.lookup(hb, None) is None
    pool.check_integrity()
    pool.free([a, b])
    assert pool.lookup(hb, None) is None
    pool.allocate(2)  # the two never-used blocks
    taken = pool.allocate(1)
    assert taken == [a]  # a was freed first: least recently freed
    assert pool.lookup(ha, None) is None and pool.lookup(hb, None) is None
    pool.check_integrity()


def test_duplicate_registration_first_writer_wins_and_eviction_keeps_the_map_consistent(
) -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    h = hash_block(None, [5, 6, 7, 8])
    pool.register(a, h, None)
    pool.register(b, h, None)  # the same content computed twice (two requests in one step)
    assert pool.lookup(h, None) == a
    pool.register(a, hash_block(None, [0, 0, 0, 0]), None)  # a registered block keeps its hash
    assert pool.lookup(h, None) == a
    pool.free([b, a])
    assert pool.allocate(1) not in ([a], [b])  # the never-used block first
    assert pool.allocate(1) == [b]  # b evicted: a's entry survives
    assert pool.lookup(h, None) == a
    pool.check_integrity()


def test_a_duplicates_child_is_published_under_the_twin_lookups_reach() -> None:
    """Two requests computed the same first block in one step (a and its duplicate b); b's
    next block is registered after b. Lookups walk the published blocks (a), so b's child
    must be reachable after a: otherwise no later prompt hits it, nor can publish its own."""
    pool = BlockPool(4)
    a, b, child = pool.allocate(3)
    first = hash_block(None, [1, 2, 3, 4])
    second = hash_block(first, [5, 6, 7, 8])
    pool.register(a, first, None)
    pool.register(b, first, None)  # the duplicate: a stays the published one
    pool.register(child, second, b)
    assert pool.lookup(first, None) == a
    assert pool.lookup(second, a) == child
    pool.check_integrity()


def test_a_child_misses_once_its_parent_block_gets_new_content() -> None:
    """A hit needs the very parent block (and content generation) the child was registered
    after: reallocating the parent invalidates the child, even if the parent is then
    registered again under the same key."""
    pool = BlockPool(3)
    parent, child = pool.allocate(2)
    hp = hash_block(None, [1, 2])
    hc = hash_block(hp, [3, 4])
    pool.register(parent, hp, None)
    pool.register(child, hc, parent)
    assert pool.lookup(hc, parent) == child
    [other] = [b.block_id for b in pool.blocks if b.block_id not in (parent, child)]
    assert pool.lookup(hc, other) is None  # the same key after another block
    assert pool.lookup(hc, None) is None  # ... or at the first position
    pool.free([parent])  # the child stays referenced (and cached)
    assert pool.allocate(2) == [other, parent]  # the parent is evicted for new content
    pool.register(parent, hp, None)  # the same key again, but a new content generation
    assert pool.lookup(hp, None) == parent
    assert pool.lookup(hc, parent) is None
    pool.check_integrity()
    pool.free([child, parent, other])
    _all_free(pool)


def test_caching_disabled_never_registers() -> None:
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.allocate(1)
    h = hash_block(None, [1, 2])
    pool.register(block, h, None)
    assert pool.lookup(h, None) is None
    assert pool.blocks[block].block_hash is None
    pool.free([block])
    _all_free(pool)


def test_reset_prefix_cache_drops_idle_entries_only() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    ha, hb = hash_block(None, [1]), hash_block(None, [2])
    pool.register(a, ha, None)
    pool.register(b, hb, None)
    pool.free([a])
    pool.reset_prefix_cache()
    assert pool.lookup(ha, None) is None  # idle: dropped
    assert pool.lookup(hb, None) == b  # in use: kept
    pool.check_integrity()
    pool.free([b])
    _all_free(pool)


def test_hash_block_chains_over_the_parent() -> None:
    root = hash_block(None, [1, 2])
    assert hash_block(None, (1, 2)) == root
    child = hash_block(root, [3, 4])
    assert child.token_ids == (3, 4)
    assert child == hash_block(hash_block(None, [1, 2]), [3, 4])
    assert child != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert child != hash_block(None, [3, 4])


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.blocks[block].ref_count = 0  # referenced-count lost while out of the free queue
    with pytest.raises(AssertionError, match="ref/free mismatch"):
        pool.check_integrity()
    pool.blocks[block].ref_count = 1
    pool.check_integrity()
    pool.register(block, hash_block(None, [1]), None)
    pool.blocks[block].block_hash = hash_block(None, [2])  # map entry no longer matches
    with pytest.raises(AssertionError):
        pool.check_integrity()
