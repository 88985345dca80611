"""core/router.py: the policies, health, the bounded prefix index, and agreement with the
block manager's own prefix-cache hashes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.core import router as router_mod
from iterserve.core.block_manager import BlockManager, block_hashes
from iterserve.core.request import Request, SamplingParams
from iterserve.core.router import ReplicaLoad, Router
from iterserve.errors import NoHealthyReplicaError

POLICIES = ("round_robin", "least_loaded", "prefix_aware")


def loads(n, running=0, waiting=0, kv=0.0, max_num_seqs=8, unhealthy=()):
    return [ReplicaLoad(f"r{i}", running, waiting, kv, max_num_seqs, i not in unhealthy)
            for i in range(n)]


# --- hashes ---------------------------------------------------------------------------------
def test_block_hashes_are_the_block_managers_chain():
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
    tokens = list(range(3, 26))                   # 23 tokens: 5 full blocks of 4
    req = Request("a", tokens, SamplingParams(max_tokens=1))
    keys = bm._keys_for(req, 5)
    assert block_hashes(tokens, 4) == [hash(k) for k in keys]
    assert block_hashes(tokens[:3], 4) == []
    # a different first block changes every hash after it (the chain)
    other = block_hashes([99] + tokens[1:], 4)
    assert all(a != b for a, b in zip(other, block_hashes(tokens, 4)))


def test_router_and_engine_agree_on_the_cached_prefix():
    """What the router believes a replica holds is what that replica's prefix cache finds."""
    bs = 4
    r = Router("prefix_aware", block_size=bs)
    engines = [BlockManager(num_blocks=64, block_size=bs, enable_prefix_caching=True)
               for _ in range(2)]
    system = [7] * 12
    ld = loads(2)
    first = r.route(system + [1, 2, 3, 4, 5], ld)
    bm = engines[first]
    req = Request("a", system + [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    assert bm.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    second_prompt = system + [9, 9, 9, 9, 9]
    assert r.route(second_prompt, ld) == first
    hit = bm.find_cached_blocks(Request("b", second_prompt, SamplingParams(max_tokens=1)))
    assert len(hit) == 3                           # the 12-token system prompt, 3 blocks


# --- health ---------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_all_unhealthy_is_a_clear_error(policy):
    r = Router(policy, block_size=4)
    with pytest.raises(NoHealthyReplicaError, match="all unhealthy"):
        r.route([1] * 10, loads(3, unhealthy={0, 1, 2}))
    with pytest.raises(NoHealthyReplicaError, match="none registered"):
        r.route([1] * 10, [])


def test_bad_arguments():
    with pytest.raises(ValueError, match="router must be one of"):
        Router("random", block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        Router("round_robin", block_size=0)
    with pytest.raises(ValueError, match="cache_capacity_blocks"):
        Router("prefix_aware", block_size=4, cache_capacity_blocks=0)


load_st = st.builds(
    lambda i, run, wait, kv, h: ReplicaLoad(f"r{i}", run, wait, kv, 8, h),
    st.integers(0, 5), st.integers(0, 12), st.integers(0, 12),
    st.floats(0, 1), st.booleans())


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(POLICIES),
       calls=st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=40),
                                st.lists(load_st, min_size=1, max_size=6)),
                      min_size=1, max_size=30))
def test_never_picks_an_unhealthy_replica(policy, calls):
    r = Router(policy, block_size=4, cache_capacity_blocks=8)
    for prompt, ld in calls:
        # replica ids must be unique within one call
        ld = [ReplicaLoad(f"r{i}", x.num_running, x.num_waiting, x.kv_usage, x.max_num_seqs,
                          x.healthy) for i, x in enumerate(ld)]
        if not any(x.healthy for x in ld):
            with pytest.raises(NoHealthyReplicaError):
                r.route(prompt, ld)
            continue
        i = r.route(prompt, ld)
        assert 0 <= i < len(ld) and ld[i].healthy
        for x in ld:
            assert r.cached_blocks(x.replica_id) <= 8


# --- round robin ----------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 9), calls=st.integers(1, 200))
def test_round_robin_is_fair(n, calls):
    r = Router("round_robin", block_size=16)
    counts = [0] * n
    for _ in range(calls):
        counts[r.route([1, 2, 3], loads(n, running=5))] += 1
    assert max(counts) - min(counts) <= 1
    assert sum(counts) == calls


def test_round_robin_goes_round_whatever_order_the_replicas_are_listed_in():
    import random

    rng = random.Random(1)
    r = Router("round_robin", block_size=16)
    counts: dict[str, int] = {}
    for _ in range(60):
        ld = loads(5)
        rng.shuffle(ld)
        rid = ld[r.route([1], ld)].replica_id
        counts[rid] = counts.get(rid, 0) + 1
    assert counts == {f"r{i}": 12 for i in range(5)}


def test_round_robin_skips_unhealthy_and_stays_fair_among_the_rest():
    r = Router("round_robin", block_size=16)
    picks = [r.route([1], loads(4, unhealthy={1})) for _ in range(9)]
    assert 1 not in picks
    assert sorted(picks.count(i) for i in (0, 2, 3)) == [3, 3, 3]


# --- least loaded ---------------------------------------------------------------------------
def test_least_loaded_counts_requests_then_kv():
    r = Router("least_loaded", block_size=16)
    ld = [ReplicaLoad("a", 4, 2, 0.1, 8), ReplicaLoad("b", 3, 1, 0.9, 8),
          ReplicaLoad("c", 4, 0, 0.2, 8), ReplicaLoad("d", 0, 0, 0.0, 8, healthy=False)]
    assert r.route([1], ld) == 2              # 4 requests, lower KV than b's 4
    ld[2].num_waiting = 3
    assert r.route([1], ld) == 1


def test_least_loaded_spreads_a_burst_over_idle_replicas():
    r = Router("least_loaded", block_size=16, seed=3)
    ld = loads(4)
    for _ in range(8):
        i = r.route([1], ld)
        ld[i].num_waiting += 1                # the replica reports the new request
    assert [x.num_waiting for x in ld] == [2, 2, 2, 2]


# --- prefix aware ---------------------------------------------------------------------------
def test_prefix_aware_follows_the_prefix_and_spreads_new_ones():
    r = Router("prefix_aware", block_size=4)
    ld = loads(3, running=2)
    groups = {g: [100 + g] * 16 for g in range(3)}
    home = {g: r.route(groups[g] + [g, 1], ld) for g in range(3)}
    assert sorted(home.values()) == [0, 1, 2]  # new prefixes go to the emptiest index
    for k in range(20):
        g = k % 3
        assert r.route(groups[g] + [50 + k] * 5, ld) == home[g]
    assert r.num_prefix_routed == 20 and r.num_fallbacks == 0


def test_prefix_aware_falls_back_when_the_holder_is_overloaded():
    r = Router("prefix_aware", block_size=4)
    ld = loads(2, running=1, max_num_seqs=8)
    prompt = [5] * 32
    home = r.route(prompt, ld)
    other = 1 - home
    # gap 2 requests (threshold max(2, 0.25 * 8) = 2): not more than the gap -> stay
    ld[home].num_waiting = 2
    assert r.route(prompt, ld) == home
    ld[home].num_waiting = 3                   # load 4 vs 1: > 2 and > 1.5x
    assert r.route(prompt, ld) == other
    assert r.num_fallbacks == 1
    # after the fallback both hold the prefix: the less loaded holder wins
    assert r.route(prompt, ld) == other
    # a full KV pool with a queue is overloaded even at equal loads
    ld = loads(2, running=4, waiting=1)
    r2 = Router("prefix_aware", block_size=4)
    h = r2.route(prompt, ld)
    ld[h].kv_usage = 0.97
    assert r2.route(prompt, ld) == 1 - h


def test_longest_prefix_wins_over_a_shorter_one():
    r = Router("prefix_aware", block_size=4)
    ld = loads(2)
    a = r.route([1] * 8 + [2] * 8, ld)          # 4 blocks on a
    b = 1 - a
    r._index.record(f"r{b}", block_hashes([1] * 8, 4))   # b holds only 2 of them
    assert r.route([1] * 8 + [2] * 8 + [3] * 4, ld) == a


@settings(max_examples=100, deadline=None)
@given(groups=st.integers(1, 6), replicas=st.integers(1, 6),
       seq=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10**6)), min_size=1,
                    max_size=40),
       run=st.lists(st.integers(0, 6), min_size=6, max_size=6))
def test_prefix_aware_picks_the_holder_when_not_overloaded(groups, replicas, seq, run):
    """Loads within the balance threshold of each other: a prompt whose prefix was routed
    before goes to a replica that was sent that prefix."""
    r = Router("prefix_aware", block_size=4, cache_capacity_blocks=10_000)
    # max_num_seqs 32: the absolute gap allowed is 8 > any gap drawn here
    ld = [ReplicaLoad(f"r{i}", run[i], 0, 0.1, 32) for i in range(replicas)]
    sent: dict[int, set[int]] = {}
    for g, salt in seq:
        g %= groups
        prompt = [1000 + g] * 12 + [salt] * 4
        i = r.route(prompt, ld)
        if g in sent:
            assert i in sent[g]
        sent.setdefault(g, set()).add(i)


def test_index_is_bounded_lru_and_remove_forgets():
    r = Router("prefix_aware", block_size=2, cache_capacity_blocks=4)
    ld = loads(1)
    r.route([1, 1, 2, 2], ld)                  # 2 blocks
    r.route([3, 3, 4, 4, 5, 5], ld)            # 3 more: the oldest is evicted
    assert r.cached_blocks("r0") == 4
    n, _ = r._index.longest(block_hashes([1, 1, 2, 2], 2), {"r0"})
    assert n == 0                               # its first block went first (LRU)
    r.remove_replica("r0")
    assert r.cached_blocks("r0") == 0 and not r._index.holders
    r.remove_replica("never-seen")             # idempotent


def test_thresholds_are_documented_module_constants():
    doc = router_mod.__doc__
    for name in ("MIN_MATCH_BLOCKS", "BALANCE_ABS_MIN", "BALANCE_ABS_FRAC", "BALANCE_REL",
                 "KV_HIGH"):
        assert name in doc and hasattr(router_mod, name)
