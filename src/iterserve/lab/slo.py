"""SLO experiments in the lab: the engine's capacity, and goodput of fcfs vs slo under load.

The experiment's claim: on Poisson arrivals at 1.5x and 2x the engine's capacity, the `slo`
policy's goodput (requests/s meeting both the TTFT and the TPOT target) is at least 1.5x
fcfs's; below capacity (0.8x) they are equal within noise. Everything here is `run_lab`
with options, so the CLI, `POST /v1/lab/run` and the page can run the same cases.

Capacity is measured, not assumed: the same workload and knobs with every request at t=0
(a saturating burst) under fcfs, in requests per simulated second. `--search` asks the
targets' question instead: per policy, the highest Poisson rate at which a given share of
the requests (90% by default, DistServe's SLO attainment) meets both targets. The preset (`PRESET`)
is the bench `poisson` mix (prompts 8-40 tokens, 80% answers of 10-100 tokens, 20% of
250-500) on the shipped `smollm2-cpu` cost model with 64 slots, TTFT <= 1 s and
TPOT <= 100 ms: at that size a full batch decodes at ~230 ms a token, so fcfs under
overload breaks both targets while `slo` holds the batch near 25 and refuses what cannot
start in time.
"""

from __future__ import annotations

from typing import Any

from iterserve.core.cost_model import load_cost_model
from iterserve.errors import CostModelError, LabOptionsError
from iterserve.lab.api import run_lab
from iterserve.lab.cluster import highest_rate_meeting
from iterserve.lab.preset_scale import scale_options, speed

PRESET: dict[str, Any] = {
    "batching": "continuous", "max_num_seqs": 64, "requests": 300, "prompt_len": [8, 40],
    "short_frac": 0.8, "short": [10, 100], "long": [250, 500],
    "slo_ttft_ms": 1000.0, "slo_tpot_ms": 100.0, "cost_model": "smollm2-cpu",
}
# The targets above are for the reference fit: in the shipped fit's time (preset_scale.py).
PRESET = scale_options(PRESET, speed())
LOAD_FACTORS = (0.8, 1.5, 2.0)


def _options(options: dict[str, Any]) -> dict[str, Any]:
    opts = dict(options)
    if isinstance(opts.get("cost_model"), str):
        opts["cost_model"] = load_cost_model(opts["cost_model"])
    return opts


def capacity_rps(options: dict[str, Any] | None = None) -> float:
    """Requests per simulated second the knobs sustain on this mix (an fcfs burst at t=0)."""
    opts = _options({**PRESET, **(options or {})})
    for key in ("arrival_rate", "arrival_rate_s", "slo_ttft_ms", "slo_tpot_ms"):
        opts.pop(key, None)
    opts["scheduling_policy"] = "fcfs"
    r = run_lab(opts)["continuous"]
    return r["requests"] / r["time_s"]


def goodput_comparison(options: dict[str, Any] | None = None,
                       load_factors=LOAD_FACTORS) -> dict[str, Any]:
    """fcfs vs slo at each load factor x capacity: the lab reports and the goodput ratio."""
    base = {**PRESET, **(options or {})}
    cap = capacity_rps(base)
    rows = []
    for f in load_factors:
        row: dict[str, Any] = {"load": f, "arrival_rate_s": f * cap}
        for policy in ("fcfs", "slo"):
            r = run_lab(_options({**base, "scheduling_policy": policy,
                                  "arrival_rate_s": f * cap}))["continuous"]
            row[policy] = {k: r[k] for k in (
                "goodput_rps", "slo_met", "refused", "requests", "time_s", "p99_ttft_s",
                "mean_ttft_s", "p99_itl_s", "mean_itl_s", "throughput_tokens_per_s")
                if k in r}
        for policy in ("fcfs", "slo"):
            r = row[policy]
            admitted = r["requests"] - r.get("refused", 0)
            # The promise: the share of admitted requests that met both targets.
            r["admitted_met"] = r["slo_met"] / admitted if admitted else None
        g_f, g_s = row["fcfs"]["goodput_rps"], row["slo"]["goodput_rps"]
        row["goodput_ratio"] = g_s / g_f if g_f > 0 else float("inf")
        rows.append(row)
    return {"capacity_rps": cap, "options": {k: v for k, v in base.items()
                                             if k != "cost_model"} | {
        "cost_model": base["cost_model"] if isinstance(base["cost_model"], str) else "custom"},
        "rows": rows}


SEARCH_ITERATIONS = 7
# DistServe's "SLO attainment": the share of all offered requests (refused ones count as
# missed) that meet both targets; its capacity is the highest rate keeping 90%.
DEFAULT_ATTAINMENT = 0.9


def search_capacity(options: dict[str, Any] | None = None,
                    attainment: float = DEFAULT_ATTAINMENT,
                    iterations: int = SEARCH_ITERATIONS) -> dict[str, Any]:
    """Per policy, the highest Poisson arrival rate (requests per simulated second) at which
    at least `attainment` of the requests meet both targets: bisection between 0 and the
    burst capacity x 1.5, widened (doubled) while the top still meets. What a user sizing a
    machine for given targets asks; the burst capacity alone ignores the targets."""
    if not 0 < attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {attainment}")
    base = {**PRESET, **(options or {})}
    cap = capacity_rps(base)
    policies: dict[str, Any] = {}
    for policy in ("fcfs", "slo"):
        runs: list[dict[str, Any]] = []

        def meets(rate: float) -> bool:
            r = run_lab(_options({**base, "scheduling_policy": policy,
                                  "arrival_rate_s": rate}))["continuous"]
            share = r["slo_met"] / r["requests"]
            runs.append({"arrival_rate_s": rate, "attained": share,
                         "goodput_rps": r["goodput_rps"], "refused": r.get("refused", 0),
                         "meets": share >= attainment})
            return share >= attainment

        lo, bounded = highest_rate_meeting(meets, cap * 1.5, iterations)
        policies[policy] = {"max_rate_rps": lo if lo > 0 else None, "bounded": bounded,
                            "load": lo / cap if cap > 0 else None, "runs": runs}
    return {"capacity_rps": cap, "attainment": attainment,
            "slo_ttft_ms": base.get("slo_ttft_ms"), "slo_tpot_ms": base.get("slo_tpot_ms"),
            "policies": policies}


def register(subparsers):
    """`iterserve lab slo`: the preset as a command (the goodput table in one line)."""
    p = subparsers.add_parser(
        "slo", help="goodput of fcfs vs slo at 0.8x / 1.5x / 2x (--loads) the engine's capacity",
        description="Run the SLO preset (bench poisson mix, smollm2-cpu cost model, 64 slots, "
                    f"TTFT <= {PRESET['slo_ttft_ms']:g} ms, TPOT <= {PRESET['slo_tpot_ms']:g} "
                    "ms) under fcfs and slo at each load factor.")
    p.add_argument("--seed", type=int, default=None, help="workload seed (default: the lab's)")
    p.add_argument("--requests", type=int, default=PRESET["requests"])
    p.add_argument("--slo-ttft-ms", type=float, default=PRESET["slo_ttft_ms"])
    p.add_argument("--slo-tpot-ms", type=float, default=PRESET["slo_tpot_ms"])
    p.add_argument("--max-num-seqs", type=int, default=PRESET["max_num_seqs"])
    p.add_argument("--cost-model", default=PRESET["cost_model"], metavar="FILE|NAME")
    p.add_argument("--loads", default=",".join(f"{f:g}" for f in LOAD_FACTORS),
                   help="load factors x the measured capacity, comma-separated "
                        "(e.g. 0.5,1,1.5,2,3,4)")
    p.add_argument("--search", action="store_true",
                   help="find, per policy, the highest arrival rate at which --attainment of "
                        "the requests meet both targets (instead of the --loads table)")
    p.add_argument("--attainment", type=float, default=DEFAULT_ATTAINMENT,
                   help="with --search: the share of requests that must meet both targets")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import json
    import sys

    opts = {"requests": args.requests, "slo_ttft_ms": args.slo_ttft_ms,
            "slo_tpot_ms": args.slo_tpot_ms, "max_num_seqs": args.max_num_seqs,
            "cost_model": args.cost_model}
    if args.seed is not None:
        opts["seed"] = args.seed
    try:
        if args.search:
            result = search_capacity(opts, args.attainment)
        else:
            loads = tuple(float(x) for x in args.loads.split(","))
            if not loads or any(not (f > 0) for f in loads):
                raise ValueError(f"--loads must be positive numbers, got {args.loads!r}")
            result = goodput_comparison(opts, loads)
    except (LabOptionsError, CostModelError, ValueError) as e:
        print(f"iterserve lab slo: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
        return 0
    if args.search:
        print(f"burst capacity {result['capacity_rps']:.2f} requests/s; the highest rate at "
              f"which {100 * args.attainment:g}% of requests meet TTFT <= "
              f"{args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms:")
        for policy, r in result["policies"].items():
            rate = r["max_rate_rps"]
            shown = ("none (even a trickle misses)" if rate is None else
                     f"{'>= ' if not r['bounded'] else ''}{rate:.2f} requests/s "
                     f"({r['load']:.2f}x the burst capacity)")
            print(f"  {policy:>5}: {shown}")
        return 0
    print(f"capacity {result['capacity_rps']:.2f} requests/s; TTFT <= {args.slo_ttft_ms:g} ms, "
          f"TPOT <= {args.slo_tpot_ms:g} ms; goodput = requests/s meeting both")
    print(f"{'load':>6} {'rate':>7} {'fcfs goodput':>13} {'slo goodput':>12} {'refused':>8} "
          f"{'ratio':>7} {'admitted met (fcfs / slo)':>26}")
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    for row in result["rows"]:
        met = f"{pct(row['fcfs']['admitted_met'])} / {pct(row['slo']['admitted_met'])}"
        print(f"{row['load']:>5}x {row['arrival_rate_s']:>7.2f} "
              f"{row['fcfs']['goodput_rps']:>13.2f} {row['slo']['goodput_rps']:>12.2f} "
              f"{row['slo']['refused']:>8} {row['goodput_ratio']:>6.2f}x {met:>26}")
    return 0
