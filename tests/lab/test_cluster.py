"""lab/cluster.py: N replicas behind the server's Router on simulated time.

The anchor is that one replica reproduces the single-replica lab exactly (same first-token
and finish times), so the cluster loop adds routing and nothing else; then that routing
does what each policy promises on workloads built for it, that the searches answer their
questions, and that bad options get a message naming them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from iterserve.cli import main
from iterserve.core.cost_model import load_cost_model
from iterserve.errors import LabOptionsError
from iterserve.lab.api import plan_lab
from iterserve.lab.cluster import (
    plan_cluster, run_cluster_lab, search_rate, search_replicas, simulate_cluster,
    summarize_cluster)
from iterserve.lab.simulator import simulate
from iterserve.lab.workload import (
    PREFIX_TOKEN_BASE, SharedPrefixSpec, draw_prefix_groups, prompt_token_ids)

CPU = load_cost_model("smollm2-cpu")


def base(**kw):
    opts = {"requests": 200, "prompt_len": [8, 40], "max_num_seqs": 8, "cost_model": CPU,
            "arrival_rate_s": 6.0}
    opts.update(kw)
    return opts


@pytest.mark.parametrize("extra", [
    {},
    {"arrival_rate_s": None},                                       # a burst at t=0
    {"num_kv_blocks": 40, "preemption_mode": "swap"},               # memory pressure
    {"scheduling_policy": "priority", "num_kv_blocks": 40},
    {"arrival_rate_s": None, "prompt_len": None},                   # prefill ignored
])
def test_one_replica_is_the_single_lab_exactly(extra):
    opts = {k: v for k, v in base(**extra).items() if v is not None}
    p = plan_lab({**opts, "batching": "continuous"})
    single = simulate(list(p.specs), p.settings["continuous"], p.cost)
    S = single.step_start_s
    res = simulate_cluster(plan_cluster({**opts, "data_parallel_size": 1}))
    idx = np.array([s.index for s in p.specs])
    assert np.array_equal(S[single.first_token], res.first_token_s[idx])
    assert np.array_equal(S[single.finish], res.finish_s[idx])
    assert res.makespan_s == S[-1]
    assert int(res.preemptions.sum()) == int(single.preemptions.sum())
    assert res.per_replica[0]["steps"] == single.steps


def test_every_request_is_served_once_and_the_books_balance():
    res = simulate_cluster(plan_cluster(base(data_parallel_size=3, router="least_loaded")))
    s = summarize_cluster(res)
    assert s["served"] == 200 and s["refused"] == 0
    assert sorted(np.bincount(res.replica, minlength=3).tolist()) == sorted(
        r["requests"] for r in s["per_replica"])
    assert sum(r["tokens"] for r in s["per_replica"]) == s["tokens"]
    assert np.all(res.first_token_s > res.arrival_s)
    assert np.all(res.finish_s >= res.first_token_s)
    for r in s["per_replica"]:
        assert 0 < r["busy_frac"] <= 1 and 0 < r["slot_utilization"] <= r["busy_frac"]
    json.dumps(s)                                   # JSON-ready


def test_round_robin_spreads_requests_evenly():
    res = simulate_cluster(plan_cluster(base(data_parallel_size=4, router="round_robin")))
    assert np.bincount(res.replica).tolist() == [50, 50, 50, 50]


def test_more_replicas_lower_ttft_at_the_same_rate():
    plan = plan_cluster(base(arrival_rate_s=4.0))
    p99 = [summarize_cluster(simulate_cluster(plan, replicas=n))["p99_ttft_s"]
           for n in (1, 2, 4)]
    assert p99[0] > p99[1] > p99[2]


def test_least_loaded_beats_round_robin_on_uneven_requests():
    """Long and short answers: counting each replica's requests keeps queues shorter than
    taking turns blindly."""
    plan = plan_cluster(base(data_parallel_size=4, arrival_rate_s=5.0, requests=300,
                             short_frac=0.6))
    rr = summarize_cluster(simulate_cluster(plan, router="round_robin"))
    ll = summarize_cluster(simulate_cluster(plan, router="least_loaded"))
    assert ll["p99_ttft_s"] < rr["p99_ttft_s"]


def test_prefix_aware_doubles_the_hit_rate_of_round_robin_on_shared_prefixes():
    """The prefix-routing criterion for the replicas, here in the lab: 64 system prompts of 256
    tokens over 4 replicas whose KV pools (392 blocks) hold about a third of them each.
    Round robin sends each group everywhere, so every replica keeps evicting prefixes it
    will need again; prefix-aware keeps a group on its replica (~16 groups each, which
    fit)."""
    plan = plan_cluster(base(data_parallel_size=4, requests=400, arrival_rate_s=3.0,
                             prefix_groups=64, prefix_len=256, enable_prefix_caching=True))
    got = {pol: summarize_cluster(simulate_cluster(plan, router=pol))
           for pol in ("round_robin", "prefix_aware")}
    rr, pa = got["round_robin"], got["prefix_aware"]
    assert pa["prefix_cache_hit_rate"] >= 2 * rr["prefix_cache_hit_rate"] > 0
    assert pa["mean_ttft_s"] < rr["mean_ttft_s"]
    assert pa["router_stats"]["prefix_routed"] > 250


def test_prefix_aware_falls_back_to_load_when_one_prefix_is_hot():
    """Every request shares one prefix: prefix-aware must not pile them all on one replica."""
    plan = plan_cluster(base(data_parallel_size=4, requests=300, arrival_rate_s=6.0,
                             prefix_groups=1, prefix_len=64, enable_prefix_caching=True))
    res = simulate_cluster(plan, router="prefix_aware")
    s = summarize_cluster(res)
    assert s["router_stats"]["fallbacks"] > 0
    assert min(np.bincount(res.replica, minlength=4)) > 30
    assert s["prefix_cache_hit_rate"] > 0.3


def test_shared_prefix_workload_tokens():
    shared = SharedPrefixSpec(groups=3, prefix_len=5)
    g = draw_prefix_groups(1000, shared, seed=1)
    assert set(g) == {0, 1, 2} and g == draw_prefix_groups(1000, shared, seed=1)
    skewed = draw_prefix_groups(2000, SharedPrefixSpec(3, 5, zipf=2.0), seed=1)
    assert skewed.count(0) > 2 * skewed.count(1)
    plan = plan_cluster(base(prefix_groups=3, prefix_len=5))
    for spec, grp in zip(plan.lab.specs[:20], plan.lab.prefix_groups):
        ids = prompt_token_ids(spec, grp, 5)
        assert len(ids) == spec.prompt_len and 13 <= spec.prompt_len <= 45
        assert ids[:5] == [PREFIX_TOKEN_BASE + grp] * 5 and ids[5] not in ids[:5]
    # without prompt_len given, a shared-prefix run turns prefill on (20-100 + the prefix)
    plan = plan_cluster({"prefix_groups": 2, "prefix_len": 32, "requests": 10})
    assert not plan.settings.prefill_ignored
    assert all(52 <= s.prompt_len <= 132 for s in plan.lab.specs)


def test_search_rate_finds_the_knee_and_it_holds():
    opts = base(data_parallel_size=2, requests=150)
    out = search_rate(opts, p99_ttft_ms=1500, iterations=5)
    best = out["max_rate_rps"]
    assert best and 0.3 * out["capacity_rps"] < best
    at = run_cluster_lab({**opts, "arrival_rate_s": best})
    assert at["p99_ttft_s"] <= 1.5
    above = [r for r in out["runs"] if r["arrival_rate_s"] > best]
    assert above and not any(r["meets"] for r in above)


def test_search_replicas_is_the_fewest_that_meet_the_target():
    opts = base(requests=150, arrival_rate_s=6.0)
    out = search_replicas(opts, p99_ttft_ms=1000, max_replicas=16)
    n = out["replicas"]
    assert n and n > 1
    meets = {r["replicas"]: r["meets"] for r in out["runs"]}
    assert meets[n] and not meets.get(n - 1, False)
    assert not search_replicas(opts, p99_ttft_ms=1, max_replicas=2)["replicas"]


@pytest.mark.parametrize("options, option, text", [
    ({"data_parallel_size": 0}, "data_parallel_size", "at least 1"),
    ({"data_parallel_size": "2"}, "data_parallel_size", "integer"),
    ({"router": "random"}, "router", "must be one of round_robin, least_loaded"),
    ({"replicas": 2}, "replicas", "unknown option"),
    ({"arrival_rate": 1.0}, "arrival_rate", "arrival_rate_s"),
    ({"request_timeout": 5.0}, "request_timeout", "not supported"),
    ({"batching": "both"}, "batching", "one mode"),
    ({"prefix_groups": 3}, "prefix_len", "both"),
    ({"search": "rate"}, "search_p99_ttft_ms", "target"),
    ({"search": "replicas", "search_p99_ttft_ms": 100.0}, "arrival_rate_s", "rate"),
    ({"max_num_seqs": 0}, "max_num_seqs", "at least 1"),
])
def test_bad_options_name_the_option(options, option, text):
    with pytest.raises(LabOptionsError, match=text) as e:
        plan_cluster(options)
    assert e.value.option == option


def test_cli_cluster_table_and_json(capsys):
    argv = ["lab", "--replicas", "2", "--router", "prefix_aware", "--requests", "60",
            "--prompt-len", "8-40", "--arrival-rate-s", "4", "--prefix-groups", "2",
            "--prefix-len", "32", "--enable-prefix-caching", "--cost-model", "smollm2-cpu",
            "--max-num-seqs", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "over 2 replicas of 8 slots, router prefix_aware" in out
    assert "prefix-cache hit rate" in out and "slot util" in out
    assert main(argv + ["--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = run_cluster_lab({"data_parallel_size": 2, "router": "prefix_aware", "requests": 60,
                            "prompt_len": [8, 40], "arrival_rate_s": 4.0, "prefix_groups": 2,
                            "prefix_len": 32, "enable_prefix_caching": True,
                            "cost_model": CPU, "max_num_seqs": 8})
    assert got == json.loads(json.dumps(want))
    # -dp and --data-parallel-size are the same flag
    assert main(["lab", "-dp", "3", "--requests", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replicas"] == 3
    assert main(["lab", "--data-parallel-size", "2", "--requests", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replicas"] == 2


def test_cli_cluster_search_and_errors(capsys):
    assert main(["lab", "--replicas", "2", "--requests", "80", "--prompt-len", "8-40",
                 "--cost-model", "smollm2-cpu", "--search", "rate",
                 "--search-p99-ttft-ms", "1500"]) == 0
    assert "highest rate with p99 TTFT <= 1500 ms on 2 replicas" in capsys.readouterr().out
    assert main(["lab", "--replicas", "0"]) == 2
    assert "data_parallel_size: must be at least 1" in capsys.readouterr().err
    assert main(["lab", "--replicas", "2", "--trace", "x.json"]) == 2
    assert "--trace is not available in cluster runs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:             # argparse checks the choices
        main(["lab", "--router", "nope"])
    assert e.value.code == 2


def test_cluster_lab_stays_torch_free():
    import subprocess
    import sys

    code = ("import sys; from iterserve.lab.cluster import run_cluster_lab; "
            "run_cluster_lab({'requests': 5}); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
