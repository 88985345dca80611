"""The lab's step semantics, pinned on hand-made length lists (docs/lab.md, "Step semantics").

A request admitted into a free slot at the start of step s with L output tokens produces a
token in each of steps s .. s+L-1, finishes at s+L, and its slot is free for step s+L.
Static batching takes up to `slots` waiting requests when nothing runs and admits no other
until the whole group has finished; continuous batching fills every free slot each step.
"""

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.lab.api import run_lab


def run(lengths, slots, batching, **extra):
    return run_lab({"lengths": lengths, "max_num_seqs": slots, "batching": batching,
                    "per_request": True, **extra})[batching]


def test_static_batching_runs_groups_back_to_back_3_1_2_on_2_slots():
    # Group {3, 1} runs steps 0-2 (the 1 finishes at 1 but its slot stays idle),
    # then {2} runs steps 3-4: 3 + 2 = 5 steps.
    r = run([3, 1, 2], 2, "static")
    assert r["steps"] == 5
    assert [p["finish"] for p in r["per_request"]] == [3, 1, 5]
    assert [p["latency"] for p in r["per_request"]] == [3, 1, 5]
    assert r["mean_latency"] == 3.0
    assert r["utilization"] == 6 / (5 * 2)
    assert r["tokens"] == 6


def test_continuous_batching_fills_a_freed_slot_the_next_step_3_1_2_on_2_slots():
    # The 1-token request frees slot 1 for step 1, where the 2-token request runs 1-2.
    r = run([3, 1, 2], 2, "continuous")
    assert r["steps"] == 3
    assert [p["finish"] for p in r["per_request"]] == [3, 1, 3]
    assert r["mean_latency"] == 7 / 3
    assert r["utilization"] == 1.0


def test_a_request_admitted_at_step_s_with_L_tokens_occupies_its_slot_for_steps_s_to_s_plus_L():
    r = run([3, 1, 2], 2, "continuous")
    segs = {p["id"]: p["segments"] for p in r["per_request"]}
    assert segs["req-000000"] == [{"slot": 0, "start": 0, "end": 3, "kind": "decode"}]
    assert segs["req-000001"] == [{"slot": 1, "start": 0, "end": 1, "kind": "decode"}]
    assert segs["req-000002"] == [{"slot": 1, "start": 1, "end": 3, "kind": "decode"}]
    third = r["per_request"][2]
    assert (third["first_scheduled"], third["first_token"], third["finish"]) == (1, 2, 3)


def test_static_batching_reuses_the_lowest_slot_for_the_next_group():
    r = run([3, 1, 2], 2, "static")
    assert r["per_request"][2]["segments"] == [{"slot": 0, "start": 3, "end": 5,
                                                "kind": "decode"}]


def test_one_slot_serialises_requests_in_arrival_order():
    for mode in ("static", "continuous"):
        r = run([4, 2, 3], 1, mode)
        assert [p["finish"] for p in r["per_request"]] == [4, 6, 9]
        assert r["steps"] == 9 and r["utilization"] == 1.0


def test_static_group_waits_for_its_longest_member_even_with_free_slots():
    # 3 slots, lengths [5, 1, 1, 1]: the 4th request waits for the whole first group (5 steps).
    r = run([5, 1, 1, 1], 3, "static")
    assert [p["finish"] for p in r["per_request"]] == [5, 1, 1, 6]
    c = run([5, 1, 1, 1], 3, "continuous")
    assert [p["finish"] for p in c["per_request"]] == [5, 1, 1, 2]


def test_timeline_counts_requests_per_step():
    r = run([3, 1, 2], 2, "continuous")
    tl = r["timeline"]
    assert tl["running"] == [2, 2, 2]
    assert tl["waiting"] == [1, 0, 0]
    assert tl["finished"] == [1, 1, 3]
    assert tl["preempted"] == [0, 0, 0]
    assert len(tl["kv_blocks_used"]) == 3 and tl["num_kv_blocks"] >= 2


# An independent statement of the two rules (a test oracle, not used by the lab).
def oracle_static(lengths, slots):
    t, finish = 0, []
    for i in range(0, len(lengths), slots):
        group = lengths[i:i + slots]
        finish += [t + n for n in group]
        t += max(group)
    return finish


def oracle_continuous(lengths, slots):
    free_at = [0] * slots             # when each slot is next free
    finish = []
    for n in lengths:                 # arrival order; the earliest free slot takes it
        s = heapq.heappop(free_at)
        finish.append(s + n)
        heapq.heappush(free_at, s + n)
    return finish


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=14), st.integers(1, 5))
def test_finish_steps_match_the_rules_on_random_length_lists(lengths, slots):
    for mode, oracle in (("static", oracle_static), ("continuous", oracle_continuous)):
        r = run_lab({"lengths": lengths, "max_num_seqs": slots, "batching": mode,
                     "per_request": True})[mode]
        expected = oracle(lengths, slots)
        assert [p["finish"] for p in r["per_request"]] == expected
        assert r["steps"] == max(expected)
        assert r["utilization"] == sum(lengths) / (max(expected) * slots)
