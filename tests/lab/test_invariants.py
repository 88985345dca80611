"""Whatever the options, a lab run is consistent: every token produced once, no slot holds
two requests at a time, the KV pool and max_num_seqs are never exceeded."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.lab.api import run_lab

options = st.fixed_dictionaries({
    "batching": st.sampled_from(["static", "continuous"]),
    "max_num_seqs": st.integers(1, 6),
    "lengths": st.lists(st.integers(1, 30), min_size=1, max_size=16),
    "prompt_len": st.one_of(st.none(), st.tuples(st.integers(1, 40), st.integers(40, 80))),
    "arrival_rate": st.one_of(st.none(), st.floats(0.05, 3.0)),
    "enable_chunked_prefill": st.booleans(),
    "max_num_batched_tokens": st.one_of(st.none(), st.integers(8, 64)),
    "block_size": st.sampled_from([1, 4, 16]),
    "kv_slack": st.integers(0, 20),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "seed": st.integers(0, 100),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(options)
def test_runs_are_consistent_under_any_options(opts):
    opts = dict(opts)
    if opts["prompt_len"] is not None:
        opts["prompt_len"] = list(opts["prompt_len"])
    longest = (opts["prompt_len"][1] if opts["prompt_len"] else 1) + max(opts["lengths"])
    if not opts["enable_chunked_prefill"] and opts["max_num_batched_tokens"] is not None:
        opts["max_num_batched_tokens"] = max(opts["max_num_batched_tokens"], longest)
    # A KV pool from "just the longest request" (many preemptions) to roomy.
    need = -(-longest // opts["block_size"])
    opts["num_kv_blocks"] = need + opts.pop("kv_slack") * need // 4
    mode = opts["batching"]
    r = run_lab({**opts, "per_request": True})[mode]

    assert r["tokens"] == sum(opts["lengths"])
    assert 0 < r["utilization"] <= 1
    tl = r["timeline"]
    assert len(tl["running"]) == r["steps"]
    assert max(tl["running"]) <= opts["max_num_seqs"]
    assert max(tl["kv_blocks_used"]) <= opts["num_kv_blocks"]
    assert tl["finished"][-1] == len(opts["lengths"])
    by_slot: dict[int, list[tuple[int, int]]] = {}
    for p in r["per_request"]:
        assert p["arrival"] <= p["first_scheduled"] < p["first_token"] <= p["finish"]
        assert p["finish"] <= r["steps"]
        for seg in p["segments"]:
            assert 0 <= seg["slot"] < opts["max_num_seqs"] and seg["start"] < seg["end"]
            by_slot.setdefault(seg["slot"], []).append((seg["start"], seg["end"]))
        assert p["segments"][0]["start"] == p["first_scheduled"]
        assert p["segments"][-1]["end"] == p["finish"]
        assert len(p["segments"]) >= 1 + p["preemptions"]
    for spans in by_slot.values():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
