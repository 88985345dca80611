"""Every lab option changes what it says it changes."""

import pytest

from iterserve.errors import LabOptionsError
from iterserve.lab.api import run_lab


def lab(**opts):
    return run_lab(opts)


def per_request(**opts):
    return run_lab({**opts, "per_request": True})


def test_batching_selects_the_modes_run():
    assert set(lab(batching="static", requests=5)) == {"static"}
    assert set(lab(batching="continuous", requests=5)) == {"continuous"}


def test_slots_bound_the_running_requests():
    r = per_request(batching="continuous", max_num_seqs=3, requests=20)["continuous"]
    assert r["slots"] == 3 and max(r["timeline"]["running"]) == 3
    assert {s["slot"] for p in r["per_request"] for s in p["segments"]} == {0, 1, 2}


def test_requests_and_seed_set_the_draw():
    a = per_request(batching="continuous", requests=30, seed=1)["continuous"]
    b = per_request(batching="continuous", requests=30, seed=2)["continuous"]
    assert a["requests"] == 30
    assert [p["output_len"] for p in a["per_request"]] != [p["output_len"] for p in b["per_request"]]


def test_short_long_and_short_frac_shape_the_lengths():
    r = per_request(batching="static", requests=200, short=[5, 6], long=[40, 41],
                    short_frac=0.5)["static"]
    lens = [p["output_len"] for p in r["per_request"]]
    assert set(lens) <= {5, 6, 40, 41}
    assert all(p["long"] == (p["output_len"] >= 40) for p in r["per_request"])
    assert 60 < sum(p["long"] for p in r["per_request"]) < 140
    only_short = per_request(batching="static", requests=50, short_frac=1.0)["static"]
    assert not any(p["long"] for p in only_short["per_request"])


def test_lengths_replace_the_draw():
    r = per_request(batching="static", lengths=[7, 3])["static"]
    assert [p["output_len"] for p in r["per_request"]] == [7, 3]
    assert r["requests"] == 2 and r["tokens"] == 10


def test_arrival_rate_spreads_arrivals_and_latency_counts_from_arrival():
    r = per_request(batching="continuous", requests=40, arrival_rate=0.05)["continuous"]
    arrivals = [p["arrival"] for p in r["per_request"]]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 100
    for p in r["per_request"]:
        assert p["latency"] == p["finish"] - p["arrival"]
        assert p["first_scheduled"] >= p["arrival"]
    # At 1 request per 20 steps the 8 slots are rarely all busy.
    assert r["utilization"] < 0.9


def test_prompt_len_turns_prefill_on_with_ttft_itl_and_preemptions_in_the_report():
    r = per_request(batching="continuous", requests=30, prompt_len=[20, 40],
                    max_num_batched_tokens=64)["continuous"]
    for key in ("mean_ttft", "p50_ttft", "p99_ttft", "mean_itl", "p99_itl", "preemptions"):
        assert key in r
    assert all(20 <= p["prompt_len"] <= 40 for p in r["per_request"])
    kinds = {s["kind"] for p in r["per_request"] for s in p["segments"]}
    assert kinds == {"prefill", "decode"}
    assert r["mean_ttft"] >= 1 and r["mean_itl"] >= 1


def test_a_small_token_budget_with_chunked_prefill_splits_prompts_into_chunks():
    r = per_request(batching="continuous", lengths=[2], prompt_len=[100, 100],
                    max_num_batched_tokens=30)["continuous"]
    p = r["per_request"][0]
    # 100 prompt tokens in chunks of 30: 4 steps of prefill, then the second token.
    assert p["segments"] == [{"slot": 0, "start": 0, "end": 4, "kind": "prefill"},
                             {"slot": 0, "start": 4, "end": 5, "kind": "decode"}]
    assert p["ttft"] == 4 and r["steps"] == 5


def test_without_chunked_prefill_a_prompt_is_computed_in_one_step():
    r = per_request(batching="continuous", lengths=[2], prompt_len=[100, 100],
                    enable_chunked_prefill=False)["continuous"]
    assert r["per_request"][0]["ttft"] == 1 and r["steps"] == 2


def test_a_small_kv_pool_forces_preemptions():
    opts = dict(batching="continuous", requests=40, max_num_seqs=8, prompt_len=[50, 100])
    assert lab(**opts)["continuous"]["preemptions"] == 0
    tight = per_request(**opts, num_kv_blocks=60, block_size=16)["continuous"]
    assert tight["preemptions"] > 0
    assert max(tight["timeline"]["kv_blocks_used"]) <= 60
    assert max(tight["timeline"]["preempted"]) > 0
    preempted = [p for p in tight["per_request"] if p["preemptions"]]
    assert any(e["event"] == "preempted" for e in preempted[0]["events"])
    assert len(preempted[0]["segments"]) >= 2


def test_swap_preemption_recomputes_nothing():
    opts = dict(batching="continuous", requests=40, max_num_seqs=8, prompt_len=[50, 100],
                num_kv_blocks=60)
    recompute = lab(**opts, preemption_mode="recompute")["continuous"]
    swap = lab(**opts, preemption_mode="swap")["continuous"]
    assert swap["preemptions"] > 0
    assert swap["computed_tokens"] == swap["prompt_tokens"] + swap["tokens"] - swap["requests"]
    assert recompute["computed_tokens"] > swap["computed_tokens"]


def test_block_size_sets_the_kv_granularity():
    r = per_request(batching="continuous", lengths=[10], prompt_len=[20, 20],
                    block_size=4)["continuous"]
    assert r["timeline"]["kv_blocks_used"][-1] == 8      # 29 tokens held in blocks of 4


def test_priority_policy_serves_the_urgent_class_first():
    opts = dict(batching="continuous", requests=200, max_num_seqs=4, prompt_len=[10, 20],
                arrival_rate=0.2, scheduling_policy="priority", priority_frac=0.3)
    r = per_request(**opts)["continuous"]
    urgent = [p["latency"] for p in r["per_request"] if p["priority"] == 0]
    normal = [p["latency"] for p in r["per_request"] if p["priority"] == 1]
    assert 30 < len(urgent) < 90
    assert sum(urgent) / len(urgent) < 0.5 * sum(normal) / len(normal)


def test_cost_model_gives_seconds_from_the_linear_formula():
    cost = {"c0": 0.5, "c_tok": 0.1, "c_seq": 0.01, "c_kv": 0.001}
    r = lab(batching="continuous", lengths=[3, 1, 2], max_num_seqs=2, cost_model=cost)["continuous"]
    # Steps 0-2 each compute 2 sequences x 1 token; K/V read: 1+1, 2+1, 3+2 positions.
    assert r["time_s"] == pytest.approx(3 * 0.5 + 6 * 0.1 + 6 * 0.01 + 10 * 0.001)
    assert r["throughput_tokens_per_s"] == pytest.approx(6 / r["time_s"])


def test_per_request_records_carry_events_and_segments():
    r = per_request(batching="static", lengths=[2, 1], max_num_seqs=1)["static"]
    first, second = r["per_request"]
    assert set(first) >= {"id", "arrival", "first_scheduled", "first_token", "finish",
                          "prompt_len", "output_len", "long", "priority", "latency", "ttft",
                          "preemptions", "segments", "events"}
    assert second["first_scheduled"] == 2 and second["finish"] == 3
    names = [e["event"] for e in second["events"]]
    assert names[0] == "arrived" and names[-1] == "finished" and "first_token" in names
    assert all({"event", "step", "time", "time_s"} <= set(e) for e in second["events"])


def test_idle_steps_between_sparse_arrivals_are_counted_but_cost_nothing_to_simulate():
    import time

    t = time.perf_counter()
    r = per_request(batching="continuous", lengths=[2, 3], arrival_rate=1e-5, seed=4,
                    cost_model={"c0": 1.0, "idle_step_s": 0.5})["continuous"]
    assert time.perf_counter() - t < 5
    first, second = r["per_request"]
    assert second["arrival"] > 10_000 and second["latency"] == 3
    assert r["steps"] == second["finish"]
    assert r["time_s"] == 5 * 1.0 + (r["steps"] - 5) * 0.5   # 5 busy steps, the rest idle
    assert len(r["timeline"]["running"]) == r["steps"]
    assert r["timeline"]["finished"][second["arrival"] - 1] == 1


def _chunks(records):
    return [e["num_tokens"] for r in records for e in r["events"] if e["event"] == "prefill_chunk"]


def test_longprompt_mix_and_long_prefill_token_threshold_cap_every_chunk():
    base = dict(batching="continuous", mix="longprompt", requests=40, seed=3)
    free = per_request(**base)["continuous"]["per_request"]
    assert max(r["prompt_len"] for r in free) >= 1500 > min(r["prompt_len"] for r in free)
    assert max(_chunks(free)) >= 1500                     # a long prompt in one chunk
    capped = per_request(**base, long_prefill_token_threshold=128)["continuous"]["per_request"]
    assert [r["prompt_len"] for r in capped] == [r["prompt_len"] for r in free]
    assert max(_chunks(capped)) == 128


def test_max_num_partial_prefills_lets_several_prompts_prefill_at_once():
    opts = dict(batching="continuous", requests=8, prompt_len=[400, 400],
                max_num_batched_tokens=512, long_prefill_token_threshold=100, lengths=None)
    one = lab(**opts)["continuous"]
    four = lab(**opts, max_num_partial_prefills=4)["continuous"]
    assert four["mean_ttft"] < one["mean_ttft"]


def test_prefix_caching_serves_the_shared_prompt_prefix_from_the_cache():
    opts = dict(batching="continuous", requests=16, prompt_len=[64, 64], block_size=16)
    off = per_request(**opts)["continuous"]["per_request"]
    on = per_request(**opts, enable_prefix_caching=True)["continuous"]["per_request"]
    cached = [e.get("num_cached_tokens", 0) for r in on for e in r["events"]
              if e["event"] == "scheduled"]
    assert max(cached) == 48 and sum(_chunks(on)) < sum(_chunks(off))


@pytest.mark.parametrize("name, value", [("max_num_partial_prefills", 0),
                                         ("long_prefill_token_threshold", -1),
                                         ("enable_prefix_caching", "yes"),
                                         ("mix", "bursty")])
def test_scheduler_knobs_are_checked_by_the_schema_and_errors_name_them(name, value):
    with pytest.raises(LabOptionsError, match=name) as e:
        run_lab({name: value})
    assert e.value.option == name
