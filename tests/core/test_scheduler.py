"""The scheduler, one test per rule (and the semantics the lab relies on)."""

import pytest

from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.request import FinishReason, Request, RequestStatus, SamplingParams
from iterserve.core.scheduler import Scheduler
from iterserve.errors import ConfigError, QueueFullError, SamplingParamsError

TOKEN = 7


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(clock=None, **kw):
    cache = {k: kw.pop(k) for k in ("block_size", "num_kv_blocks", "num_swap_blocks",
                                    "enable_prefix_caching") if k in kw}
    cache.setdefault("block_size", 4)
    cache.setdefault("num_kv_blocks", 256)
    # The rules below are about budgets and queues; their prompts share blocks by chance, and
    # a prefix hit would change the chunks they count. The cache's own tests turn it on.
    cache.setdefault("enable_prefix_caching", False)
    return Scheduler(SchedulerConfig(**kw), CacheConfig(**cache), clock=clock or Clock())


def req(rid, prompt_len=1, max_tokens=4, prompt=None, ignore_eos=True, **kw):
    prompt = prompt if prompt is not None else [100 + (hash(rid) + i) % 50 for i in range(prompt_len)]
    sp_kw = {k: kw.pop(k) for k in ("stop_token_ids",) if k in kw}
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                               **sp_kw), **kw)


def step(s, token=TOKEN):
    out = s.schedule()
    s.check_consistency()
    finished = s.update_from_output(out, {rid: token for rid in sampling(s, out)})
    s.check_consistency()
    return out, finished


def ids(reqs):
    return [r.request_id for r in reqs]


def scheduled(out):
    return dict(out.num_scheduled_tokens)


def sampling(s, out):
    """Ids whose tokens this step reach their request's end (what an executor samples)."""
    return [rid for rid, n in out.num_scheduled_tokens.items()
            if s.get_request(rid) is not None
            and s.get_request(rid).num_computed_tokens + n >= s.get_request(rid).num_tokens]


# --- the lab's timing semantics --------------------------------------------------------------
def test_one_token_prompt_runs_max_tokens_steps_and_frees_its_slot_the_next_step():
    s = make(max_num_seqs=1)
    s.add_request(req("a", max_tokens=3))
    s.add_request(req("b", max_tokens=1))
    runs = []
    for _ in range(4):
        out, finished = step(s)
        runs.append((out.step, list(out.num_scheduled_tokens), ids(finished)))
    assert runs == [(0, ["a"], []), (1, ["a"], []), (2, ["a"], ["a"]), (3, ["b"], ["b"])]


def test_continuous_batching_fills_every_free_slot_every_step():
    s = make(max_num_seqs=2)
    s.add_request(req("short", max_tokens=1))
    s.add_request(req("long", max_tokens=3))
    s.add_request(req("next", max_tokens=1))
    assert sorted(scheduled(step(s)[0])) == ["long", "short"]
    assert sorted(scheduled(step(s)[0])) == ["long", "next"]


def test_static_batching_admits_a_group_only_when_idle_and_no_refill_until_it_finishes():
    s = make(max_num_seqs=2, batching="static")
    s.add_request(req("a", max_tokens=1))
    s.add_request(req("b", max_tokens=3))
    s.add_request(req("c", max_tokens=1))
    assert sorted(scheduled(step(s)[0])) == ["a", "b"]
    assert list(scheduled(step(s)[0])) == ["b"]       # a's slot stays empty
    assert list(scheduled(step(s)[0])) == ["b"]
    assert list(scheduled(step(s)[0])) == ["c"]       # next group once b finished


# --- limits ----------------------------------------------------------------------------------
def test_token_budget_caps_tokens_scheduled_per_step():
    s = make(max_num_batched_tokens=10, max_num_seqs=8)
    for k in range(4):
        s.add_request(req(f"r{k}", prompt_len=4))
    out, _ = step(s)
    assert out.num_batched_tokens == 10 == sum(out.num_scheduled_tokens.values())
    assert scheduled(out) == {"r0": 4, "r1": 4, "r2": 2}


def test_max_num_seqs_caps_running_requests():
    s = make(max_num_seqs=3)
    for k in range(5):
        s.add_request(req(f"r{k}"))
    out, _ = step(s)
    assert out.num_seqs == 3 and s.num_running == 3 and s.num_waiting == 2


def test_running_requests_are_served_before_waiting_ones():
    s = make(max_num_batched_tokens=8, max_num_seqs=8)
    s.add_request(req("dec", prompt_len=2, max_tokens=5))
    step(s)
    s.add_request(req("big", prompt_len=20))
    out, _ = step(s)
    assert scheduled(out) == {"dec": 1, "big": 7}


def test_prompt_as_long_as_max_model_len_is_rejected_precisely():
    s = make(max_model_len=16, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="16 tokens but max_model_len is 16"):
        s.add_request(req("a", prompt_len=16))
    assert not s.has_unfinished_requests()


def test_request_that_can_never_fit_in_the_kv_pool_is_rejected():
    s = make(num_kv_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="need 3 KV blocks.*only 2"):
        s.add_request(req("a", prompt_len=5, max_tokens=5))
    s.add_request(req("fits", prompt_len=5, max_tokens=4))   # 8 tokens computed at most


def test_duplicate_request_id_is_rejected():
    s = make()
    s.add_request(req("a"))
    with pytest.raises(ValueError, match="already"):
        s.add_request(req("a"))


def test_bounded_waiting_queue_rejects_new_work_with_queue_full_error():
    s = make(max_queued_requests=2)
    s.add_request(req("a"))
    s.add_request(req("b"))
    with pytest.raises(QueueFullError, match="max_queued_requests=2"):
        s.add_request(req("c"))
    step(s)                                   # both admitted: room again
    s.add_request(req("c"))


# --- chunked prefill -------------------------------------------------------------------------
def test_chunked_prefill_splits_a_long_prompt_and_shares_steps_with_decodes():
    s = make(max_num_batched_tokens=8, max_num_seqs=4)
    s.add_request(req("dec", prompt_len=2, max_tokens=8))
    step(s)
    s.add_request(req("long", prompt_len=20, max_tokens=2))
    chunks = []
    for _ in range(3):
        out, _ = step(s)
        assert out.num_batched_tokens <= 8
        chunks.append(scheduled(out))
    assert chunks == [{"dec": 1, "long": 7}, {"dec": 1, "long": 7}, {"dec": 1, "long": 6}]
    long_req = s.get_request("long")
    assert long_req.num_output_tokens == 1       # sampled only when the prompt was done


def test_long_prefill_token_threshold_caps_one_requests_chunk():
    s = make(max_num_batched_tokens=64, long_prefill_token_threshold=5, max_num_partial_prefills=2)
    s.add_request(req("long", prompt_len=12))
    s.add_request(req("short", prompt_len=3))
    out, _ = step(s)
    assert scheduled(out) == {"long": 5, "short": 3}


def test_max_num_partial_prefills_caps_prompts_mid_prefill_but_not_short_prompts():
    s = make(max_num_batched_tokens=16, long_prefill_token_threshold=4,
             max_num_partial_prefills=1)
    s.add_request(req("long1", prompt_len=40))
    s.add_request(req("short", prompt_len=3))
    s.add_request(req("long2", prompt_len=40))
    s.add_request(req("short2", prompt_len=3))
    out, _ = step(s)
    # long1 is mid-prefill; short completes in this step; long2 would be a second partial:
    # it keeps its place, and short2 behind it completes within the budget left (with a
    # threshold the chunks leave budget on purpose; it would idle otherwise).
    assert scheduled(out) == {"long1": 4, "short": 3, "short2": 3}
    assert ids(s.waiting) == ["long2"]


def test_a_prompt_over_the_partial_cap_keeps_its_place_and_starts_when_a_slot_frees():
    s = make(max_num_batched_tokens=16, long_prefill_token_threshold=4,
             max_num_partial_prefills=1, max_num_seqs=8)
    s.add_request(req("long1", prompt_len=8))
    s.add_request(req("long2", prompt_len=12))
    s.add_request(req("mid", prompt_len=6))          # would be partial too (6 > 4)
    s.add_request(req("short", prompt_len=2))
    out, _ = step(s)
    assert scheduled(out) == {"long1": 4, "short": 2}
    assert ids(s.waiting) == ["long2", "mid"]        # order kept
    out, _ = step(s)                  # long1's last chunk: long2 (the head) takes the slot
    assert scheduled(out) == {"long1": 4, "short": 1, "long2": 4}
    assert ids(s.waiting) == ["mid"]
    out, _ = step(s)
    assert scheduled(out)["long2"] == 4 and "mid" not in scheduled(out)


def test_without_a_threshold_the_partial_cap_still_blocks_in_queue_order():
    # No threshold: a chunk in flight takes all the budget left, so nothing is passed over
    # (strict FCFS, as before): here the budget is what stops long2, not the cap.
    s = make(max_num_batched_tokens=16, max_num_partial_prefills=1)
    s.add_request(req("long1", prompt_len=40))
    s.add_request(req("short", prompt_len=3))
    out, _ = step(s)
    assert scheduled(out) == {"long1": 16}
    assert ids(s.waiting) == ["short"]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    s = make(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=16)
    s.add_request(req("a", prompt_len=10))
    s.add_request(req("b", prompt_len=10))
    out, _ = step(s)
    assert scheduled(out) == {"a": 10}
    out, _ = step(s)
    assert scheduled(out) == {"a": 1, "b": 10}


# --- KV pressure and preemption --------------------------------------------------------------
def test_admission_only_when_the_requests_blocks_fit():
    s = make(num_kv_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", prompt_len=12, max_tokens=4))
    s.add_request(req("b", prompt_len=5))
    out, _ = step(s)
    assert scheduled(out) == {"a": 12}          # b needs 2 blocks, only 1 is free
    assert s.num_waiting == 1


def test_kv_pressure_preempts_the_latest_arrived_request_by_recompute():
    clock = Clock()
    s = make(clock, num_kv_blocks=2, block_size=2, max_num_seqs=2)
    s.add_request(req("old", prompt_len=2, max_tokens=3, arrival_time=0.0))
    s.add_request(req("new", prompt_len=2, max_tokens=3, arrival_time=1.0))
    step(s)                                      # both prefilled, one block each, pool full
    out, _ = step(s)                             # both need a second block
    assert out.preempted_req_ids == ["new"] and scheduled(out) == {"old": 1}
    new = s.get_request("new")
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and s.stats().num_preemptions == 1
    assert [e.detail for e in new.events if e.name == "preempted"] == [{"mode": "recompute"}]
    while s.has_unfinished_requests():
        step(s)
    assert new.num_output_tokens == 3 and new.finish_reason is FinishReason.LENGTH
    # Recompute re-runs prompt + the output it already had as one prefill chunk.
    assert any(e.name == "resumed" for e in new.events)


def test_recompute_victim_is_requeued_at_the_front_of_the_waiting_queue():
    s = make(num_kv_blocks=2, block_size=2, max_num_seqs=2)
    s.add_request(req("old", prompt_len=2, max_tokens=3))
    s.add_request(req("new", prompt_len=2, max_tokens=3, arrival_time=1.0))
    step(s)
    s.add_request(req("later", prompt_len=1, arrival_time=2.0))
    step(s)
    assert s.waiting.peek().request_id == "new"


def test_victim_already_scheduled_this_step_returns_its_budget():
    s = make(num_kv_blocks=5, block_size=2, max_num_seqs=2, scheduling_policy="priority",
             max_num_batched_tokens=8)
    s.add_request(req("lazy", prompt_len=3, max_tokens=6, priority=5, arrival_time=0.0))
    step(s)                                  # lazy: 3 tokens computed, 2 blocks
    s.add_request(req("urgent", prompt_len=2, max_tokens=6, priority=0, arrival_time=1.0))
    out, _ = step(s)                         # urgent prefills; lazy yields it the step
    assert scheduled(out) == {"urgent": 2}
    out, _ = step(s)                         # both decode; urgent takes a 2nd block
    assert scheduled(out) == {"lazy": 1, "urgent": 1}
    out, _ = step(s)                         # lazy takes the last block (its 3rd)
    assert scheduled(out) == {"lazy": 1, "urgent": 1} and not out.preempted_req_ids
    # lazy (first in the running list) fits; then urgent needs a 3rd block for its 5th
    # token: lazy, the less urgent, is preempted after it was scheduled.
    out, _ = step(s)
    assert out.preempted_req_ids == ["lazy"]
    assert scheduled(out) == {"urgent": 1}
    assert out.num_batched_tokens == 1


def test_swap_preemption_moves_blocks_to_host_and_swaps_back_in_without_recompute():
    s = make(num_kv_blocks=2, block_size=2, num_swap_blocks=4, preemption_mode="swap",
             max_num_seqs=2)
    s.add_request(req("old", prompt_len=2, max_tokens=3))
    s.add_request(req("new", prompt_len=2, max_tokens=3, arrival_time=1.0))
    step(s)
    out, _ = step(s)
    assert out.swapped_out_req_ids == ["new"] and len(out.blocks_to_swap_out) == 1
    host_blocks = [h for _, h in out.blocks_to_swap_out]
    new = s.get_request("new")
    assert new.status is RequestStatus.SWAPPED and new.num_computed_tokens == 2
    assert s.num_swapped == 1
    swapped_in = None
    while s.has_unfinished_requests():
        out, _ = step(s)
        if out.swapped_in_req_ids:
            swapped_in = out
    assert swapped_in.swapped_in_req_ids == ["new"]
    assert [h for h, _ in swapped_in.blocks_to_swap_in] == host_blocks
    assert scheduled(swapped_in)["new"] == 1          # resumed with a decode, not a prefill
    names = [e.name for e in new.events]
    assert names.index("swapped_out") < names.index("swapped_in") < names.index("finished")
    assert new.num_output_tokens == 3


def test_swap_falls_back_to_recompute_when_swap_space_is_full():
    s = make(num_kv_blocks=2, block_size=2, num_swap_blocks=0, preemption_mode="swap",
             max_num_seqs=2)
    s.add_request(req("old", prompt_len=2, max_tokens=3))
    s.add_request(req("new", prompt_len=2, max_tokens=3, arrival_time=1.0))
    step(s)
    out, _ = step(s)
    assert out.preempted_req_ids == ["new"] and out.swapped_out_req_ids == []


# --- priority policy -------------------------------------------------------------------------
def test_priority_policy_admits_the_most_urgent_waiting_request_first():
    s = make(scheduling_policy="priority", max_num_seqs=1)
    s.add_request(req("lazy", priority=3, arrival_time=0.0))
    s.add_request(req("urgent", priority=0, arrival_time=1.0))
    assert list(scheduled(step(s)[0])) == ["urgent"]


def test_fcfs_policy_ignores_priority():
    s = make(scheduling_policy="fcfs", max_num_seqs=1)
    s.add_request(req("lazy", priority=3, arrival_time=0.0))
    s.add_request(req("urgent", priority=0, arrival_time=1.0))
    assert list(scheduled(step(s)[0])) == ["lazy"]


def test_priority_urgent_request_preempts_a_less_urgent_one_when_max_num_seqs_is_full():
    s = make(scheduling_policy="priority", max_num_seqs=1)
    s.add_request(req("lazy", priority=3, max_tokens=5))
    step(s)
    s.add_request(req("urgent", priority=0, arrival_time=1.0))
    out, _ = step(s)
    assert scheduled(out) == {"urgent": 1} and out.preempted_req_ids == ["lazy"]


def test_priority_equal_priority_never_preempts():
    s = make(scheduling_policy="priority", max_num_seqs=1)
    s.add_request(req("first", priority=1, max_tokens=5))
    step(s)
    s.add_request(req("second", priority=1, arrival_time=1.0))
    out, _ = step(s)
    assert scheduled(out) == {"first": 1} and out.preempted_req_ids == []


def test_priority_preempted_request_keeps_its_place_ahead_of_later_arrivals():
    s = make(scheduling_policy="priority", max_num_seqs=1)
    s.add_request(req("lazy", priority=3, max_tokens=3))
    step(s)
    s.add_request(req("urgent", priority=0, max_tokens=1, arrival_time=1.0))
    s.add_request(req("lazy-later", priority=3, arrival_time=2.0))
    step(s)                                      # urgent runs, lazy preempted
    out, _ = step(s)
    assert list(scheduled(out)) == ["lazy"]


def test_priority_less_urgent_running_requests_yield_the_step_to_an_urgent_arrival():
    """Slots and blocks are free, so nothing is preempted; still, the batch requests (a
    decode and a long prefill chunk that would take the whole budget) sit out the step in
    which the urgent request prefills, and resume the next step with their blocks."""
    s = make(scheduling_policy="priority", max_num_seqs=4, max_num_batched_tokens=16,
             enable_chunked_prefill=True)
    s.add_request(req("batch-decode", priority=1, max_tokens=8))
    step(s)
    s.add_request(req("batch-long", priority=1, prompt_len=40, arrival_time=0.5))
    out, _ = step(s)
    assert scheduled(out) == {"batch-decode": 1, "batch-long": 15}
    s.add_request(req("urgent", priority=0, prompt_len=10, max_tokens=2, arrival_time=1.0))
    out, _ = step(s)
    assert scheduled(out) == {"urgent": 10}
    assert out.preempted_req_ids == [] and out.swapped_out_req_ids == []
    out, _ = step(s)                             # urgent decodes; the batch class is back
    assert scheduled(out) == {"batch-decode": 1, "batch-long": 14, "urgent": 1}


def test_priority_equal_or_more_urgent_running_requests_do_not_yield():
    s = make(scheduling_policy="priority", max_num_seqs=4, max_num_batched_tokens=64,
             enable_chunked_prefill=True)
    s.add_request(req("urgent-old", priority=0, max_tokens=8))
    s.add_request(req("batch", priority=1, max_tokens=8, arrival_time=0.1))
    step(s)
    s.add_request(req("urgent-new", priority=0, prompt_len=5, arrival_time=1.0))
    out, _ = step(s)
    assert scheduled(out) == {"urgent-old": 1, "urgent-new": 5}
    s.add_request(req("batch-new", priority=1, prompt_len=5, arrival_time=2.0))
    out, _ = step(s)                             # a batch arrival: nobody yields
    assert scheduled(out) == {"urgent-old": 1, "batch": 1, "urgent-new": 1, "batch-new": 5}


def test_fcfs_never_yields():
    s = make(scheduling_policy="fcfs", max_num_seqs=4, max_num_batched_tokens=64,
             enable_chunked_prefill=True)
    s.add_request(req("batch", priority=1, max_tokens=8))
    step(s)
    s.add_request(req("urgent", priority=0, prompt_len=5, arrival_time=1.0))
    out, _ = step(s)
    assert scheduled(out) == {"batch": 1, "urgent": 5}


# --- ending requests -------------------------------------------------------------------------
def test_finish_reasons_length_eos_stop_token_and_max_model_len():
    s = make(max_model_len=8, max_num_batched_tokens=64)
    s.add_request(req("len", max_tokens=2))
    s.add_request(req("eos", max_tokens=5, ignore_eos=False, eos_token_id=TOKEN))
    s.add_request(req("ign", max_tokens=2, ignore_eos=True, eos_token_id=TOKEN))
    s.add_request(req("stop", max_tokens=5, stop_token_ids=[TOKEN]))
    s.add_request(req("cap", prompt_len=6, max_tokens=100))
    done = {}
    while s.has_unfinished_requests():
        for r in step(s)[1]:
            done[r.request_id] = (r.finish_reason, r.num_output_tokens)
    assert done == {"len": (FinishReason.LENGTH, 2), "eos": (FinishReason.STOP, 1),
                    "ign": (FinishReason.LENGTH, 2), "stop": (FinishReason.STOP, 1),
                    "cap": (FinishReason.LENGTH, 2)}


@pytest.mark.parametrize("state", ["waiting", "running", "preempted", "swapped"])
def test_abort_ends_a_request_in_any_state_and_frees_everything(state):
    mode = "swap" if state == "swapped" else "recompute"
    s = make(num_kv_blocks=2, block_size=2, num_swap_blocks=4, preemption_mode=mode,
             max_num_seqs=2)
    s.add_request(req("old", prompt_len=2, max_tokens=3))
    s.add_request(req("new", prompt_len=2, max_tokens=3, arrival_time=1.0))
    if state != "waiting":
        step(s)
    if state in ("preempted", "swapped"):
        step(s)
    target = "old" if state == "running" else "new"
    expected = {"waiting": RequestStatus.WAITING, "running": RequestStatus.RUNNING,
                "preempted": RequestStatus.PREEMPTED, "swapped": RequestStatus.SWAPPED}[state]
    assert s.get_request(target).status is expected
    r = s.finish_request(target, FinishReason.ABORT)
    assert r.finish_reason is FinishReason.ABORT and r.is_finished
    assert s.finish_request(target, FinishReason.ABORT) is None      # idempotent
    assert s.get_request(target) is None
    s.check_consistency()
    out, _ = step(s)
    assert out.ended_req_ids == [target]
    while s.has_unfinished_requests():
        step(s)
    assert s.block_manager.num_free_blocks == 2
    assert s.block_manager.num_free_host_blocks == 4


def test_finish_request_between_schedule_and_update_is_ignored_by_update():
    s = make()
    s.add_request(req("a", max_tokens=5))
    out = s.schedule()
    s.finish_request("a", FinishReason.STOP)
    assert s.update_from_output(out, {"a": TOKEN}) == []
    assert s.get_request("a") is None and s.block_manager.num_free_blocks == 256


def test_finish_request_unknown_id_returns_none():
    assert make().finish_request("nope", FinishReason.ABORT) is None


def test_request_deadline_times_out_in_any_state():
    clock = Clock()
    s = make(clock, max_num_seqs=1)
    both = [req("running", max_tokens=50, deadline=2.0), req("waiting", max_tokens=50, deadline=2.0)]
    for r in both:
        s.add_request(r)
    step(s)
    clock.t = 2.0
    out, _ = step(s)
    assert sorted(out.ended_req_ids) == ["running", "waiting"] == sorted(out.finished_req_ids)
    assert all(r.finish_reason is FinishReason.TIMEOUT for r in both)
    assert out.num_scheduled_tokens == {} and not s.has_unfinished_requests()


def test_queue_timeout_applies_only_while_never_admitted():
    clock = Clock()
    s = make(clock, max_num_seqs=1, queue_timeout=1.0)
    s.add_request(req("admitted", max_tokens=50))
    s.add_request(req("stuck", max_tokens=5))
    step(s)
    clock.t = 1.5
    out, _ = step(s)
    assert out.ended_req_ids == ["stuck"]
    assert s.get_request("admitted").status is RequestStatus.RUNNING


def test_config_timeouts_become_deadlines_counted_from_arrival():
    s = make(request_timeout=10.0, queue_timeout=3.0)
    r = req("a", arrival_time=5.0)
    s.add_request(r)
    assert (r.deadline, r.queue_deadline) == (15.0, 8.0)
    own = req("b", arrival_time=5.0, deadline=6.0)
    s.add_request(own)
    assert own.deadline == 6.0


def test_missing_sampled_token_is_a_precise_error():
    s = make()
    s.add_request(req("a"))
    out = s.schedule()
    with pytest.raises(ValueError, match="no token for request 'a'"):
        s.update_from_output(out, {})


# --- prefix caching --------------------------------------------------------------------------
def test_prefix_cache_hit_skips_the_cached_prompt_blocks():
    s = make(enable_prefix_caching=True, block_size=4)
    prompt = list(range(10, 20))
    s.add_request(req("first", prompt=prompt, max_tokens=1))
    step(s)
    second = req("second", prompt=prompt + [1, 2], max_tokens=1)
    s.add_request(second)
    out, _ = step(s)
    (new,) = out.scheduled_new_reqs
    assert (new.num_computed_tokens, out.num_scheduled_tokens["second"]) == (8, 4)
    assert len(new.block_ids) == 3          # two shared prefix blocks and one fresh one
    assert second.num_cached_tokens == 8
    assert s.stats().prefix_cache_hit_rate == pytest.approx(2 / (2 + 2))


def test_blocks_of_finished_requests_stay_cached_but_count_as_free():
    s = make(enable_prefix_caching=True, block_size=2, num_kv_blocks=8)
    s.add_request(req("a", prompt_len=6, max_tokens=1))
    step(s)
    st = s.stats()
    assert st.num_free_blocks == 8 and st.kv_usage == 0.0
    assert s.block_manager.num_cached_blocks == 3


# --- stats and events ------------------------------------------------------------------------
def test_stats_report_queues_kv_usage_tokens_and_preemptions():
    s = make(max_num_seqs=1, num_kv_blocks=10, block_size=4)
    s.add_request(req("a", prompt_len=5, max_tokens=3))
    s.add_request(req("b"))
    step(s)
    st = s.stats()
    assert (st.step, st.num_running, st.num_waiting, st.num_swapped) == (1, 1, 1, 0)
    assert st.num_batched_tokens == 5 and st.num_free_blocks == 8
    assert st.kv_usage == pytest.approx(0.2) and st.num_blocks == 10
    assert (st.num_preemptions, st.num_preemptions_total) == (0, 0)


def test_events_record_lifecycle_transitions_but_nothing_per_decode_step():
    s = make()
    r = req("a", prompt_len=3, max_tokens=20)
    s.add_request(r)
    while s.has_unfinished_requests():
        step(s)
    assert [e.name for e in r.events] == ["arrived", "queued", "scheduled", "prefill_chunk",
                                          "first_token", "finished"]
    assert r.events[-1].detail == {"reason": "length"} and len(r.token_times) == 20


def test_skip_idle_steps_advances_the_step_only_when_nothing_is_unfinished():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
                      CacheConfig(block_size=4, num_kv_blocks=8))
    sched.skip_idle_steps(5)
    assert sched.schedule().step == 5
    sched.add_request(Request("a", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True)))
    with pytest.raises(RuntimeError, match="unfinished"):
        sched.skip_idle_steps(1)
    with pytest.raises(ValueError):
        sched.skip_idle_steps(-1)


# --- the data-only seam and the production checks --------------------------------------------
def test_output_is_data_new_requests_once_then_diffs_and_whole_again_after_recompute():
    s = make(num_kv_blocks=2, block_size=2, max_num_seqs=2)
    s.add_request(req("old", max_tokens=3))
    out, _ = step(s)
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens, new.output_token_ids) == ("old", 0, [])
    assert len(new.block_ids) == 1 and out.scheduled_cached_reqs == []
    s.add_request(req("new", max_tokens=4, arrival_time=1.0))
    out, _ = step(s)                  # old decodes within its block: an empty diff
    assert [(c.req_id, c.new_block_ids, c.num_computed_tokens) for c in
            out.scheduled_cached_reqs] == [("old", (), 1)]
    out, _ = step(s)                  # both need a second block; the pool has none: new goes
    assert out.preempted_req_ids == ["new"]
    (c,) = out.scheduled_cached_reqs
    assert c.req_id == "old" and len(c.new_block_ids) == 1
    for _ in range(3):
        out, _ = step(s)
        if out.scheduled_new_reqs:
            break
    (again,) = out.scheduled_new_reqs  # resumed after recompute: everything, outputs too
    assert again.req_id == "new" and again.output_token_ids == [TOKEN]
    assert out.finished_req_ids == ["old"] and out.ended_req_ids == []


def test_a_swapped_in_request_comes_back_as_a_resumed_diff_with_its_whole_table():
    s = make(num_kv_blocks=2, block_size=2, num_swap_blocks=4, preemption_mode="swap",
             max_num_seqs=2)
    s.add_request(req("old", max_tokens=3))
    step(s)
    s.add_request(req("new", max_tokens=4, arrival_time=1.0))
    step(s)
    out, _ = step(s)
    assert out.swapped_out_req_ids == ["new"]
    while not out.swapped_in_req_ids:
        out, _ = step(s)
    (c,) = [c for c in out.scheduled_cached_reqs if c.req_id == "new"]
    assert c.resumed_from_preemption
    assert list(c.new_block_ids) == s.block_manager.block_table("new")


def test_consistency_violations_name_the_request_with_a_corrupted_block_table():
    s = make(num_kv_blocks=8, block_size=2)
    s.add_request(req("good", prompt_len=3))
    s.add_request(req("bad", prompt_len=3))
    step(s)
    assert s.consistency_violations() == []
    bm = s.block_manager
    bm.tables["bad"][0] = bm.tables["good"][0]       # two owners, ref counts now wrong
    bad = s.consistency_violations()
    assert bad and any(rid == "bad" for rid, _ in bad)
    bm.tables["bad"].append(99)                      # a block outside the pool
    assert ("bad", "block table names block 99, outside the pool of 8") in \
        s.consistency_violations()
    with pytest.raises(AssertionError, match="bad"):
        s.check_consistency()


def test_consistency_violations_report_a_lost_request():
    s = make()
    s.add_request(req("a"))
    s.waiting.remove(s.get_request("a"))
    assert s.consistency_violations() == [("a", "unfinished but in no queue (lost)")]


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty",
                                  "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_sampling_floats_are_rejected_by_name(name, value):
    with pytest.raises(SamplingParamsError, match=name) as e:
        SamplingParams(**{name: value}).validate()
    assert e.value.param == name
    s = make()
    with pytest.raises(SamplingParamsError):
        s.add_request(Request("x", [1], SamplingParams(**{name: value})))
    assert not s.has_unfinished_requests()


def test_end_of_step_asserts_catch_more_running_than_max_num_seqs():
    s = make(max_num_seqs=2)
    s.add_request(req("a", max_tokens=5))
    s.add_request(req("b", max_tokens=5))
    step(s)
    s.config.max_num_seqs = 1                    # the books broken behind its back
    with pytest.raises(AssertionError, match="max_num_seqs is 1"):
        s.schedule()


# --- max_long_partial_prefills (vLLM's): short prompts pass long ones mid-prefill -----------
def test_max_long_partial_prefills_passes_a_long_prompt_over_for_short_ones_behind_it():
    s = make(max_num_batched_tokens=32, long_prefill_token_threshold=8,
             max_num_partial_prefills=3, max_long_partial_prefills=1)
    for rid, n in (("long1", 40), ("long2", 40), ("short1", 6), ("long3", 40), ("short2", 6)):
        s.add_request(req(rid, prompt_len=n))
    out, _ = step(s)
    # long1 is the one long partial allowed; long2 and long3 keep their places while the
    # short prompts behind them start.
    assert scheduled(out) == {"long1": 8, "short1": 6, "short2": 6}
    assert ids(s.waiting) == ["long2", "long3"]
    out, _ = step(s)
    assert scheduled(out) == {"long1": 8, "short1": 1, "short2": 1}
    for _ in range(2):
        out, _ = step(s)
        assert "long2" not in scheduled(out)
    out, _ = step(s)      # long1 has 8 tokens left: no longer long, so long2 may start
    assert scheduled(out) == {"long1": 8, "long2": 8}


def test_max_long_partial_prefills_two_lets_two_long_prompts_prefill_together():
    s = make(max_num_batched_tokens=32, long_prefill_token_threshold=8,
             max_num_partial_prefills=3, max_long_partial_prefills=2)
    for rid in ("long1", "long2", "long3"):
        s.add_request(req(rid, prompt_len=40))
    out, _ = step(s)
    assert scheduled(out) == {"long1": 8, "long2": 8}


def test_max_long_partial_prefills_is_checked_and_off_by_default():
    with pytest.raises(ConfigError, match="max_long_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=1, max_long_partial_prefills=2).validate()
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        SchedulerConfig(max_num_partial_prefills=2, max_long_partial_prefills=1).validate()
    assert SchedulerConfig().validate().max_long_partial_prefills is None
    # Default (None): as many long partial prefills as partial prefills.
    s = make(max_num_batched_tokens=32, long_prefill_token_threshold=8,
             max_num_partial_prefills=2)
    for rid in ("long1", "long2"):
        s.add_request(req(rid, prompt_len=40))
    out, _ = step(s)
    assert scheduled(out) == {"long1": 8, "long2": 8}
    # One partial prefill: the cap cannot apply (the partial cap is the stricter one).
    s = make(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    s.add_request(req("long1", prompt_len=40))
    s.add_request(req("short", prompt_len=6))
    out, _ = step(s)
    assert scheduled(out) == {"long1": 8, "short": 6}


# --- max_long_prefill_tokens: long prompts' chunks share one cap per step ------------------
def test_max_long_prefill_tokens_keeps_the_step_that_ends_one_long_prefill_as_short():
    # 40-token prompts in chunks of 16 (the threshold), budget 48, 2 partial / 1 long.
    kw = dict(max_num_batched_tokens=48, long_prefill_token_threshold=16,
              max_num_partial_prefills=2, max_long_partial_prefills=1)
    steps = {}
    for cap in (0, 16):
        s = make(max_long_prefill_tokens=cap, **kw)
        for rid in ("long1", "long2"):
            s.add_request(req(rid, prompt_len=40))
        steps[cap] = [scheduled(step(s)[0]) for _ in range(4)]
    # Without the cap, long1's last 8 tokens leave long1 short: long2 starts next to them
    # with a whole chunk, a step of 24 prefill tokens against 16 in the others.
    assert steps[0][:3] == [{"long1": 16}, {"long1": 16}, {"long1": 8, "long2": 16}]
    # With it, long2 starts with what long1's last chunk left of the 16.
    assert steps[16][:3] == [{"long1": 16}, {"long1": 16}, {"long1": 8, "long2": 8}]
    assert steps[16][3] == {"long1": 1, "long2": 16}
    assert all(sum(n for rid, n in st.items() if n > 1) <= 16 for st in steps[16])


def test_max_long_prefill_tokens_passes_a_long_prompt_over_but_not_short_ones():
    s = make(max_num_batched_tokens=64, long_prefill_token_threshold=16,
             max_num_partial_prefills=3, max_long_prefill_tokens=16)
    for rid, n in (("long1", 40), ("long2", 40), ("short", 10)):
        s.add_request(req(rid, prompt_len=n))
    out, _ = step(s)
    # long1 takes the 16; long2 (its cap spent) keeps its place, the short prompt starts.
    assert scheduled(out) == {"long1": 16, "short": 10}
    assert ids(s.waiting) == ["long2"]
    out, _ = step(s)
    assert scheduled(out) == {"long1": 16, "short": 1}
    out, _ = step(s)
    assert scheduled(out) == {"long1": 8, "short": 1, "long2": 8}


def test_max_long_prefill_tokens_needs_a_threshold_and_is_off_by_default():
    assert SchedulerConfig().validate().max_long_prefill_tokens == 0
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        SchedulerConfig(max_long_prefill_tokens=16).validate()
    # Without chunked prefill a prompt runs whole: the cap must not starve it.
    s = make(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64,
             long_prefill_token_threshold=16, max_long_prefill_tokens=16)
    s.add_request(req("long", prompt_len=40))
    assert scheduled(step(s)[0]) == {"long": 40}


# --- priority_less_urgent_tokens: short steps while an urgent class is active --------------
def _flood(cap, guard=50):
    s = make(scheduling_policy="priority", max_num_seqs=8, max_num_batched_tokens=64,
             priority_less_urgent_tokens=cap, priority_guard_steps=guard)
    for i in range(6):
        s.add_request(req(f"b{i}", priority=1, max_tokens=50, arrival_time=i * 0.01))
    step(s)
    return s


def test_priority_less_urgent_tokens_cap_the_batch_class_only_while_an_urgent_one_is_active():
    s = _flood(cap=2, guard=3)
    out, _ = step(s)
    assert len(scheduled(out)) == 6           # no urgent class seen: the batch runs whole
    s.add_request(req("u", priority=0, prompt_len=5, max_tokens=2, arrival_time=1.0))
    out, _ = step(s)
    assert scheduled(out) == {"u": 5}        # the batch yields the urgent prefill's step
    out, _ = step(s)                         # u decodes: batch capped at 2 tokens
    assert scheduled(out)["u"] == 1 and sum(scheduled(out).values()) == 3
    seen = set(scheduled(out)) - {"u"}
    for _ in range(4):                       # u finished; the guard keeps the cap 3 steps
        out, _ = step(s)
        assert "u" not in scheduled(out)
        if len(scheduled(out)) == 6:
            break
        assert len(scheduled(out)) == 2
        seen |= set(scheduled(out))
    assert len(scheduled(out)) == 6          # the guard ran out: full steps again
    assert seen == {f"b{i}" for i in range(6)}   # round robin: every batch request ran


def test_priority_less_urgent_tokens_bound_an_arriving_batch_prefill_too():
    s = make(scheduling_policy="priority", max_num_seqs=8, max_num_batched_tokens=64,
             priority_less_urgent_tokens=4, priority_guard_steps=100)
    s.add_request(req("u", priority=0, max_tokens=20))
    step(s)
    s.add_request(req("b-long", priority=1, prompt_len=30, arrival_time=0.5))
    out, _ = step(s)
    assert scheduled(out) == {"u": 1, "b-long": 4}
    s.add_request(req("u2", priority=0, prompt_len=9, arrival_time=0.7))
    out, _ = step(s)
    assert scheduled(out) == {"u": 1, "u2": 9}   # urgent prefills are never capped


def test_priority_less_urgent_tokens_off_by_default_and_fcfs_ignores_it():
    assert SchedulerConfig().priority_less_urgent_tokens == 0
    s = make(scheduling_policy="fcfs", max_num_seqs=8, max_num_batched_tokens=64,
             priority_less_urgent_tokens=1)
    s.add_request(req("u", priority=0, max_tokens=20))
    s.add_request(req("b-long", priority=1, prompt_len=30))
    out, _ = step(s)
    assert scheduled(out) == {"u": 1, "b-long": 30}
