"""The KV block manager: allocation, ref counts, prefix cache (chained keys, LRU), swap pool."""

import pytest

from iterserve.core.block_manager import BlockManager
from iterserve.core.request import Request


def req(rid, tokens, computed=0):
    r = Request(rid, list(tokens))
    r.num_computed_tokens = computed
    return r


def admit(bm, r, n=None):
    """Admit like the scheduler does: claim cache hits, then allocate the rest."""
    hits = bm.find_cached_blocks(r)
    num_hit = len(hits) * bm.block_size
    n = r.num_tokens - num_hit if n is None else n
    assert bm.allocate_slots(r, n, hits)
    r.num_computed_tokens = num_hit
    return hits


def compute_all(bm, r):
    """Pretend the executor computed every known token."""
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)


def test_allocation_takes_ceil_tokens_over_block_size_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = req("a", range(9))
    assert bm.allocate_slots(r, 9)
    assert len(bm.block_table("a")) == 3
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.check_consistency()


def test_growth_allocates_a_block_only_when_the_last_one_is_full():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = req("a", range(3))
    assert bm.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    assert bm.allocate_slots(r, 1) and len(bm.block_table("a")) == 1
    r.num_computed_tokens = 4
    assert bm.allocate_slots(r, 1) and len(bm.block_table("a")) == 2


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    r = req("a", range(12))
    assert not bm.allocate_slots(r, 12)
    assert bm.num_free_blocks == 2 and bm.block_table("a") == []
    bm.check_consistency()


def test_free_returns_every_block_and_is_idempotent():
    bm = BlockManager(num_blocks=4, block_size=2)
    r = req("a", range(7))
    bm.allocate_slots(r, 7)
    bm.free(r)
    bm.free(r)
    assert bm.num_free_blocks == 4
    bm.check_consistency()


def test_prefix_cache_reuses_full_blocks_of_a_prompt_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req("a", range(10))
    admit(bm, a)
    compute_all(bm, a)
    b = req("b", list(range(8)) + [99, 98])
    hits = admit(bm, b)
    assert hits == bm.block_table("a")[:2]
    assert b.num_computed_tokens == 8
    assert [bm.ref_cnt[x] for x in hits] == [2, 2]
    bm.check_consistency()


def test_prefix_cache_key_chains_the_parent_so_equal_blocks_after_different_prefixes_miss():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    compute_all(bm, a)
    b = req("b", [9, 9, 3, 4, 5])          # block 2 equals a's block 2, block 1 differs
    assert bm.find_cached_blocks(b) == []


def test_prefix_cache_always_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req("a", range(8))
    admit(bm, a)
    compute_all(bm, a)
    b = req("b", range(8))                  # the same 8 tokens: only 1 block may be reused
    assert len(bm.find_cached_blocks(b)) == 1


def test_freed_cached_blocks_count_as_free_and_stay_reusable():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = req("a", range(5))
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    assert bm.num_cached_blocks == 2
    b = req("b", range(5))
    assert len(admit(bm, b)) == 2
    bm.check_consistency()


def test_cached_blocks_are_evicted_in_lru_order_after_plain_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    old = req("old", [1, 2, 3])
    admit(bm, old)
    compute_all(bm, old)
    bm.free(old)                              # its first block becomes evictable first
    new = req("new", [5, 6, 7])
    admit(bm, new)
    compute_all(bm, new)
    bm.free(new)
    # 2 cached blocks ([1,2], [5,6]) + 2 plain. A 3-block request takes both plain blocks
    # and then evicts the least recently freed cached block: old's.
    big = req("big", [8] * 6)
    assert bm.allocate_slots(big, 6)
    assert bm.find_cached_blocks(req("x", [1, 2, 0])) == []
    assert len(bm.find_cached_blocks(req("y", [5, 6, 0]))) == 1
    bm.check_consistency()


def test_swap_out_moves_computed_blocks_to_host_and_swap_in_brings_them_back():
    bm = BlockManager(num_blocks=4, block_size=2, num_swap_blocks=4)
    r = req("a", range(5))
    bm.allocate_slots(r, 5)
    r.num_computed_tokens = 3                 # 2 blocks hold computed tokens, 1 is spare
    device = list(bm.block_table("a"))
    out = bm.swap_out(r)
    assert [d for d, _ in out] == device[:2]
    assert bm.num_free_blocks == 4 and bm.num_free_host_blocks == 2
    bm.check_consistency()
    assert bm.can_swap_in(r, 1)
    back = bm.swap_in(r)
    assert [h for h, _ in back] == [h for _, h in out]
    assert bm.block_table("a") == [d for _, d in back]
    # Host blocks are released only at the end of the step (no overwrite before the copy).
    assert bm.num_free_host_blocks == 2
    bm.end_step()
    assert bm.num_free_host_blocks == 4
    bm.check_consistency()


def test_swap_out_is_refused_when_swap_space_is_too_small():
    bm = BlockManager(num_blocks=4, block_size=2, num_swap_blocks=1)
    r = req("a", range(4))
    assert bm.allocate_slots(r, 4)
    r.num_computed_tokens = 4
    assert not bm.can_swap_out(r)
    r.num_computed_tokens = 2
    assert bm.can_swap_out(r)


def test_invalid_pool_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=4)
