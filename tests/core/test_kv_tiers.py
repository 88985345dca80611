"""The KV tiers' bookkeeping (core/kv_tiers.py) and the block manager's calls into it:
digest chains and their keys, RAM and disk LRU order with pins, spill on eviction, write
through, promotion from disk, the measured-cost decision, the executor's feedback, and the
scheduler's one-step wait for a promotion."""

import pytest

from iterserve.core.block_manager import BlockManager
from iterserve.core.config import CacheConfig, ConfigError, SchedulerConfig
from iterserve.core.kv_tiers import (
    DISK, RAM, DiskTier, KVTiers, PrefixHit, RamTier, TransferCosts, block_digests, root_digest)
from iterserve.core.request import Request, SamplingParams
from iterserve.core.scheduler import Scheduler
from iterserve.core.scheduler_output import KVTierFeedback


def req(rid, tokens, computed=0):
    r = Request(rid, list(tokens), SamplingParams(max_tokens=4, ignore_eos=True))
    r.num_computed_tokens = computed
    return r


def tiered(num_blocks=4, block_size=2, ram=4, disk=0, swap=0):
    return BlockManager(num_blocks, block_size, swap, enable_prefix_caching=True,
                        num_ram_tier_blocks=ram, num_disk_tier_blocks=disk)


def run_prompt(bm, r):
    """Admit `r`, compute every token, register its blocks, free it, end the step."""
    hit = bm.find_prefix_hit(r)
    assert bm.allocate_slots(r, r.num_tokens - hit.num_blocks * bm.block_size, hit)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)
    table = bm.block_table(r.request_id)
    bm.free(r)
    return hit, table, bm.end_step()


# --- digests ---------------------------------------------------------------------------------
def test_digests_chain_the_parent_and_name_the_setting():
    root = root_digest("model-a")
    a = block_digests([1, 2, 3, 4, 5], 2, root)
    assert len(a) == 2 and a == block_digests([1, 2, 3, 4, 9], 2, root)   # partial block out
    assert block_digests([9, 2, 3, 4], 2, root)[1] != a[1]      # same block, other parent
    assert block_digests([1, 2, 3, 4], 2, root_digest("model-b")) != a   # another setting
    assert block_digests([1, 2, 3, 4], 4, root) != a[1:]         # another block size
    assert all(len(d) == 64 for d in a)


def test_digests_are_the_same_in_every_process():
    import subprocess
    import sys
    code = ("from iterserve.core.kv_tiers import block_digests, root_digest; "
            "print(block_digests(list(range(8)), 4, root_digest('k'))[-1])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)}
                           ).stdout.strip() for seed in (1, 2)}
    assert outs == {block_digests(list(range(8)), 4, root_digest("k"))[-1]}


# --- RAM and disk tiers alone ------------------------------------------------------------------
def test_ram_tier_evicts_least_recently_used_and_never_a_slot_pinned_this_step():
    ram = RamTier(first_slot=10, num_slots=2)
    a, b = ram.take("a"), ram.take("b")
    assert {a, b} == {10, 11}
    assert ram.take("c") is None              # both pinned this step
    ram.end_step()
    ram.pin("a")                              # used again: b is now the oldest
    c = ram.take("c")
    assert c == b and ram.lookup("b") is None and ram.lookup("a") == a
    assert ram.violations() == []


def test_disk_tier_keeps_its_bound_by_evicting_the_oldest_unpinned():
    disk = DiskTier(capacity=2)
    disk.add("a")
    disk.add("b")
    disk.pin("a")                             # read this step
    disk.add("c")
    assert list(disk.pending_deletes) == ["b"] and "a" in disk and "c" in disk
    disk.end_step()
    disk.add("a")                             # touched again: c is the oldest
    disk.add("d")
    assert list(disk.pending_deletes) == ["b", "c"]
    disk.add("b")                             # written again before its delete went out
    assert list(disk.pending_deletes) == ["c", "a"]


def test_disk_tier_over_its_bound_while_all_are_pinned_trims_at_the_step_end():
    disk = DiskTier(capacity=1)
    disk.add("a")
    disk.pin("a")
    disk.add("b")
    disk.pin("b")
    assert len(disk) == 2 and not disk.pending_deletes
    disk.end_step()
    assert len(disk) == 1 and list(disk.pending_deletes) == ["a"]


def test_disk_probe_finds_files_another_process_wrote():
    on_disk = {"x"}
    disk = DiskTier(capacity=4, probe=on_disk.__contains__)
    assert disk.contains("x") and "x" in disk
    assert not disk.contains("y")


# --- the block manager with tiers ----------------------------------------------------------------
def test_an_evicted_cached_block_is_saved_to_ram_and_loaded_back_into_a_fresh_block():
    bm = tiered(num_blocks=4, block_size=2, ram=4)
    a = req("a", [1, 2, 3, 4, 5])
    _, table, _ = run_prompt(bm, a)
    # A prompt that needs every block evicts a's two cached blocks: they go to RAM.
    big = req("big", [9] * 8)
    assert bm.allocate_slots(big, 8)
    ops = bm.end_step()
    assert sorted(b for b, _ in ops.ram_saves) == sorted(table[:2])
    saved = dict(ops.ram_saves)
    bm.free(big)
    # a's prompt again: not on the device any more, both blocks in RAM.
    again = req("a2", [1, 2, 3, 4, 5])
    assert bm.find_cached_blocks(again) == []
    hit = bm.find_prefix_hit(again)
    assert hit.blocks == () and sorted(hit.ram_slots) == sorted(saved.values())
    blocks = bm.allocate_slots(again, 1, hit)
    ops = bm.end_step()
    table = bm.block_table("a2")
    assert ops.ram_loads == list(zip(hit.ram_slots, table[:2]))
    assert blocks.block_ids == tuple(table)
    # Loaded blocks are cached at once: a third request shares them on the device.
    third = req("a3", [1, 2, 3, 4, 7])
    assert bm.find_cached_blocks(third) == table[:2]
    bm.check_consistency()


def test_the_ram_tier_is_inclusive_so_a_block_evicted_again_is_not_saved_twice():
    bm = tiered(num_blocks=4, block_size=2, ram=4)
    run_prompt(bm, req("a", [1, 2, 3]))
    big = req("big", [9] * 8)
    bm.allocate_slots(big, 8)
    assert len(bm.end_step().ram_saves) == 1
    bm.free(big)
    run_prompt(bm, req("a2", [1, 2, 3]))                   # loaded from RAM, freed
    bm.allocate_slots(req("big2", [8] * 8), 8)            # evicts it again
    assert bm.end_step() is None                           # RAM has it still: no copy
    bm.check_consistency()


def test_every_newly_cached_block_is_written_through_to_disk_once():
    bm = tiered(num_blocks=8, block_size=2, ram=2, disk=8)
    _, table, ops = run_prompt(bm, req("a", [1, 2, 3, 4, 5]))
    digests = block_digests([1, 2, 3, 4], 2, bm.tiers.root)
    assert ops.disk_saves == list(zip(table[:2], digests))
    _, _, ops = run_prompt(bm, req("b", [1, 2, 3, 4, 5, 6, 7]))
    assert [d for _, d in ops.disk_saves] == block_digests([1, 2, 3, 4, 5, 6], 2,
                                                           bm.tiers.root)[2:]


def test_blocks_only_on_disk_are_promoted_into_ram_and_served_the_next_step():
    bm = tiered(num_blocks=8, block_size=2, ram=4, disk=8)
    digests = block_digests([1, 2, 3, 4], 2, bm.tiers.root)
    bm.tiers.connect_disk("", digests)            # (files a previous run left)
    r = req("r", [1, 2, 3, 4, 5])
    hit = bm.find_prefix_hit(r)
    assert hit.promoting and hit.num_blocks == 0
    ops = bm.end_step()
    assert [d for d, _ in ops.disk_reads] == digests
    slots = [s for _, s in ops.disk_reads]
    hit = bm.find_prefix_hit(r)                   # next step: RAM hits, no more waiting
    assert not hit.promoting and list(hit.ram_slots) == slots
    assert bm.allocate_slots(r, 1, hit)
    ops = bm.end_step()
    assert [s for s, _ in ops.ram_loads] == slots and not ops.disk_reads
    bm.check_consistency()


def test_a_request_is_promoted_once_even_if_ram_loses_its_blocks():
    bm = tiered(num_blocks=8, block_size=2, ram=2, disk=8)
    bm.tiers.connect_disk("", block_digests([1, 2, 3, 4], 2, bm.tiers.root))
    r = req("r", [1, 2, 3, 4, 5])
    assert bm.find_prefix_hit(r).promoting
    bm.end_step()
    for d in list(bm.tiers.ram._lru.order):
        bm.tiers.ram.forget(d)
    hit = bm.find_prefix_hit(r)
    assert not hit.promoting and hit.num_blocks == 0      # it computes them instead


def test_loading_is_skipped_when_it_measured_dearer_than_recomputing():
    costs = TransferCosts(bytes_per_block=1 << 20, block_size=16)
    assert costs.worth_loading(RAM) and costs.worth_loading(DISK)
    costs.observe_compute(seconds=0.016, tokens=1600)      # 10 us a token: a fast GPU
    costs.observe_load(DISK, seconds=0.05, blocks=10)      # 5 ms a block from disk
    costs.observe_load(RAM, seconds=0.0001, blocks=10)
    assert costs.worth_loading(RAM) and not costs.worth_loading(DISK)
    costs.observe_compute(seconds=1.0, tokens=8)           # too small a step: ignored
    assert costs.measured["compute"] == 1

    bm = tiered(num_blocks=8, block_size=2, ram=4, disk=8)
    bm.tiers.costs = costs
    bm.tiers.connect_disk("", block_digests([1, 2, 3, 4], 2, bm.tiers.root))
    assert not bm.find_prefix_hit(req("r", [1, 2, 3, 4, 5])).promoting


def test_feedback_forgets_failed_reads_and_writes_and_uncaches_invalid_blocks():
    bm = tiered(num_blocks=8, block_size=2, ram=4, disk=8)
    digests = block_digests([1, 2, 3, 4], 2, bm.tiers.root)
    bm.tiers.connect_disk("", digests)
    r = req("r", [1, 2, 3, 4, 5])
    bm.find_prefix_hit(r)
    ops = bm.end_step()
    (d0, s0), (d1, s1) = ops.disk_reads
    bm.apply_tier_feedback(KVTierFeedback(failed_reads=[(d1, s1)]))
    assert bm.tiers.ram.lookup(d1) is None and d1 not in bm.tiers.disk
    hit = bm.find_prefix_hit(r)
    assert hit.ram_slots == (s0,)                          # only the good one is a hit
    bm.allocate_slots(r, 3, hit)
    loaded = bm.block_table("r")[0]
    bm.end_step()
    bm.apply_tier_feedback(KVTierFeedback(invalid_blocks=[loaded], failed_writes=[d0]))
    assert bm.find_cached_blocks(req("x", [1, 2, 3])) == []
    assert d0 not in bm.tiers.disk
    bm.check_consistency()


def test_a_swap_in_does_not_write_through_blocks_its_copy_fills_later():
    bm = tiered(num_blocks=8, block_size=2, ram=2, disk=8, swap=4)
    r = req("r", [1, 2, 3, 4, 5])
    bm.allocate_slots(r, 5)
    r.num_computed_tokens = 4
    bm.cache_full_blocks(r)
    bm.end_step()
    bm.swap_out(r)
    bm.end_step()
    bm.swap_in(r)
    ops = bm.end_step()
    assert ops is None or not ops.disk_saves
    bm.check_consistency()


def test_tiers_need_prefix_caching_and_the_disk_tier_needs_ram_slots():
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        CacheConfig(num_kv_blocks=8, num_ram_tier_blocks=4,
                    enable_prefix_caching=False).validate()
    with pytest.raises(ConfigError, match="num_ram_tier_blocks"):
        CacheConfig(num_kv_blocks=8, num_disk_tier_blocks=4).validate()
    assert CacheConfig(num_kv_blocks=8).enable_prefix_caching      # on by default


# --- the scheduler ---------------------------------------------------------------------------
def sched(**cache):
    cfg = dict(block_size=2, num_kv_blocks=16, num_ram_tier_blocks=8, num_disk_tier_blocks=16)
    cfg.update(cache)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
                     CacheConfig(**cfg))


def test_a_request_whose_blocks_are_on_disk_waits_one_step_and_starts_with_them():
    s = sched()
    prompt = list(range(1, 12))
    s.block_manager.tiers.connect_disk("", block_digests(prompt, 2, s.block_manager.tiers.root))
    s.add_request(req("r", prompt))
    s.add_request(req("other", [7, 7, 7]))
    out = s.schedule()
    assert "r" not in out.num_scheduled_tokens and "other" in out.num_scheduled_tokens
    assert len(out.kv_tiers.disk_reads) == 5
    s.update_from_output(out, {"other": 1})
    out = s.schedule()
    assert out.num_scheduled_tokens["r"] == 1               # 10 of 11 tokens from RAM
    assert len(out.kv_tiers.ram_loads) == 5
    assert s.get_request("r").num_cached_tokens == 10
    s.check_consistency()


def test_prefix_hit_without_tiers_is_the_device_hits():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    run_prompt(bm, req("a", [1, 2, 3, 4, 5]))
    hit = bm.find_prefix_hit(req("b", [1, 2, 3, 4, 5]))
    assert isinstance(hit, PrefixHit) and len(hit.blocks) == 2 and not hit.ram_slots
    assert bm.tiers is None and bm.end_step() is None


def test_kv_tiers_stats_count_what_happened():
    tiers = KVTiers(block_size=2, ram_first_slot=0, ram_slots=2, disk_blocks=4)
    tiers.on_register(0, "a" * 64)
    tiers.on_evict(0, "a" * 64)
    st = tiers.stats()
    assert st["counters"]["disk_writes"] == 1 and st["counters"]["ram_saves"] == 1
    assert st["ram"] == {"slots": 2, "used": 1, "evicted": 0}
    assert st["disk"]["used"] == 1
