"""KVCacheManager: block tables, prefix hits, all-or-nothing allocation, freeing."""

from __future__ import annotations

from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.request import Request
from core_helpers import make_request

BS = 4  # block size of every test here


def _all_free(kv: KVCacheManager) -> None:
    kv.check_integrity()
    assert kv.num_live_requests() == 0
    assert kv.num_free_blocks == kv.num_blocks


def _compute(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit a request with its prefix hits and 'compute' its whole prompt (then publish
    its full blocks, as ``Scheduler.update`` does after a step)."""
    blocks, num_cached = kv.get_computed_blocks(request)
    table = kv.allocate_slots(request, request.num_tokens - num_cached, blocks)
    assert table is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return list(table)


def test_allocate_grows_the_table_one_block_per_block_size_tokens() -> None:
    kv = KVCacheManager(8, BS)
    r = make_request("r", range(6))
    assert kv.allocate_slots(r, 6) == kv.block_tables["r"]
    assert len(kv.block_tables["r"]) == 2
    r.num_computed_tokens = 6
    for n_tokens, n_blocks in ((7, 2), (8, 2), (9, 3)):  # decodes at positions 6, 7, 8
        r.append_output_token(100)
        assert r.num_tokens == n_tokens
        table = kv.allocate_slots(r, 1)
        assert table is not None and len(table) == n_blocks
        r.num_computed_tokens += 1
    assert kv.num_free_blocks == 5
    assert abs(kv.usage - 3 / 8) < 1e-9
    kv.check_integrity()
    kv.free(r)
    _all_free(kv)


def test_prefix_hit_for_a_request_sharing_full_blocks_with_a_finished_one() -> None:
    kv = KVCacheManager(16, BS)
    first = make_request("a", range(10))  # blocks [0-3] [4-7] [8-9]
    table_a = _compute(kv, first)
    kv.free(first)
    assert kv.num_free_blocks == 16
    second = make_request("b", [*range(8), 50, 51, 52])  # shares two full blocks
    blocks, num_cached = kv.get_computed_blocks(second)
    assert blocks == table_a[:2]
    assert num_cached == 8
    table = kv.allocate_slots(second, second.num_tokens - num_cached, blocks)
    assert table is not None and table[:2] == table_a[:2] and len(table) == 3
    assert kv.num_free_blocks == 13
    assert kv.pool.stats.hits == 0  # counted by the scheduler on admission, not per lookup
    kv.check_integrity()
    kv.free(second)
    _all_free(kv)


def test_prefix_hits_while_the_owner_is_still_running_share_the_blocks() -> None:
    kv = KVCacheManager(16, BS)
    owner = make_request("a", range(12))
    table_a = _compute(kv, owner)
    other = make_request("b", [*range(8), 77])
    blocks, num_cached = kv.get_computed_blocks(other)
    assert (blocks, num_cached) == (table_a[:2], 8)
    assert kv.allocate_slots(other, 1, blocks) is not None
    assert [kv.pool.blocks[b].ref_count for b in table_a] == [2, 2, 1]
    kv.check_integrity()
    kv.free(owner)
    assert [kv.pool.blocks[b].ref_count for b in table_a] == [1, 1, 0]
    kv.free(other)
    _all_free(kv)


def test_at_least_one_token_is_always_left_to_compute() -> None:
    kv = KVCacheManager(16, BS)
    _compute(kv, make_request("a", range(12)))
    for prompt_len, expected in ((12, 8), (9, 8), (8, 4), (5, 4), (4, 0), (1, 0)):
        r = make_request(f"r{prompt_len}", range(prompt_len))
        blocks, num_cached = kv.get_computed_blocks(r)
        assert num_cached == expected, prompt_len
        assert num_cached < r.num_tokens
        assert len(blocks) * BS == num_cached


def test_blocks_are_findable_only_once_their_tokens_are_computed() -> None:
    kv = KVCacheManager(16, BS)
    a = make_request("a", range(13))  # blocks [0-3] [4-7] [8-11] [12]
    table = kv.allocate_slots(a, 13)
    assert table is not None and len(table) == 4
    probe = make_request("p", range(14))
    assert kv.get_computed_blocks(probe) == ([], 0)  # allocated, not computed: no hit
    a.num_computed_tokens = 7  # a first chunk ran: only block 0 is full and written
    kv.cache_computed_blocks(a)
    assert kv.get_computed_blocks(probe) == (table[:1], 4)
    a.num_computed_tokens = 13
    kv.cache_computed_blocks(a)
    kv.cache_computed_blocks(a)  # idempotent
    assert kv.get_computed_blocks(probe) == (table[:3], 12)  # the partial block never hits
    kv.free(a)
    assert kv.get_computed_blocks(probe) == (table[:3], 12)
    _all_free(kv)


def test_requests_admitted_together_leave_their_shared_prefix_reachable() -> None:
    """a and b share their first block and are admitted in one step (b computes a
    duplicate of it); b's second block, unique then, must stay reachable: later prompts
    with b's first two blocks hit both."""
    kv = KVCacheManager(16, BS)
    first, a_second, b_second = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a, b = make_request("a", first + a_second + [99]), make_request("b", first + b_second + [99])
    for request in (a, b):  # both allocated before either publishes (one step)
        blocks, num_cached = kv.get_computed_blocks(request)
        assert num_cached == 0 and kv.allocate_slots(request, request.num_tokens) is not None
    for request in (a, b):
        request.num_computed_tokens = request.num_tokens
        kv.cache_computed_blocks(request)
    kv.free(a)
    kv.free(b)
    for name in ("c", "d"):
        later = make_request(name, first + b_second + [42, 43])
        assert kv.get_computed_blocks(later)[1] == 2 * BS
        _compute(kv, later)
        kv.free(later)
    _all_free(kv)


def test_the_chain_matters_same_block_after_another_prefix_misses() -> None:
    kv = KVCacheManager(16, BS)
    _compute(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    r = make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # block 1 equal, block 0 differs
    assert kv.get_computed_blocks(r) == ([], 0)


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    a = make_request("a", range(9))
    _compute(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    _all_free(kv)


def test_allocate_slots_none_changes_nothing() -> None:
    kv = KVCacheManager(4, BS)
    hog = make_request("hog", range(100, 112))
    assert kv.allocate_slots(hog, 12) is not None  # 3 of 4 blocks
    r = make_request("r", range(6))
    assert not kv.can_allocate(r, 6)
    assert kv.allocate_slots(r, 6) is None
    assert "r" not in kv.block_tables
    assert kv.num_free_blocks == 1
    kv.check_integrity()
    kv.free(hog)
    _all_free(kv)


def test_allocate_slots_none_with_prefix_hits_does_not_touch_them() -> None:
    kv = KVCacheManager(4, BS)
    done = make_request("done", range(9))
    table_done = _compute(kv, done)
    kv.free(done)
    hog = make_request("hog", range(100, 104))
    assert kv.allocate_slots(hog, 4) is not None
    assert kv.num_free_blocks == 3
    r = make_request("r", [*range(8), 60, 61, 62, 63, 64])  # 13 tokens: 4 blocks
    blocks, num_cached = kv.get_computed_blocks(r)
    assert num_cached == 8 and blocks == table_done[:2]
    # 2 idle hits + 2 new blocks = 4 to take out of the free queue, 3 free
    assert not kv.can_allocate(r, r.num_tokens - num_cached, blocks)
    assert kv.allocate_slots(r, r.num_tokens - num_cached, blocks) is None
    assert "r" not in kv.block_tables
    assert kv.num_free_blocks == 3
    assert all(kv.pool.blocks[b].ref_count == 0 for b in blocks)
    assert kv.get_computed_blocks(r) == (blocks, 8)  # still cached
    kv.check_integrity()
    kv.free(hog)
    _all_free(kv)


def test_free_releases_everything_and_is_harmless_twice() -> None:
    kv = KVCacheManager(8, BS)
    requests = [make_request(f"r{i}", range(10 * i, 10 * i + 7)) for i in range(3)]
    for r in requests:
        _compute(kv, r)
    assert kv.num_free_blocks == 2
    assert kv.num_live_requests() == 3
    for r in requests:
        kv.free(r)
    _all_free(kv)
    kv.free(requests[0])  # unknown now: nothing happens
    kv.free(make_request("never", [1]))
    _all_free(kv)


def test_free_evicts_the_tail_before_the_head() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request("a", range(16))  # exactly the 4 blocks of the cache
    table = _compute(kv, a)
    kv.free(a)
    # One new block evicts a's last block; the first three stay reusable.
    other = make_request("x", [99])
    assert kv.allocate_slots(other, 1) == [table[-1]]
    r = make_request("b", [*range(12), 5])
    assert kv.get_computed_blocks(r) == (table[:3], 12)
    kv.free(other)
    _all_free(kv)


def test_block_map_shows_tables_shared_prefix_blocks_and_cached_free_ones() -> None:
    kv = KVCacheManager(16, BS)
    first = make_request("a", range(10))  # blocks [0-3] [4-7] [8-9]
    table_a = _compute(kv, first)
    second = make_request("b", [*range(8), 50, 51])  # shares a's two full blocks
    table_b = _compute(kv, second)
    live = kv.block_map()
    assert live.num_blocks == 16
    assert live.tables == {"a": tuple(table_a), "b": tuple(table_b)}
    assert live.shared == tuple(sorted(table_a[:2])) and live.cached == ()
    kv.free(first)
    kv.free(second)
    idle = kv.block_map()
    assert idle.tables == {} and idle.shared == ()
    assert sorted(idle.cached) == sorted(table_a[:2])  # full blocks stay findable
    _all_free(kv)
