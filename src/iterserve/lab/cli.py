"""`iterserve lab`: static vs continuous batching on the engine's own scheduler, from a shell.

`iterserve lab` with no options runs the reference case (48 requests at t=0, 8 slots, 80%
short / 20% long answers, prefill ignored) and prints both modes side by side. Every option
maps to a `run_lab` option (see iterserve.lab.api); `--json` prints the same dict the HTTP
endpoint returns. `--serve` serves the /lab page without a model.

Bad input (an unknown choice, a malformed range or lengths file, --max-num-seqs 0, ...) prints
one clear line on stderr and exits with status 2, like argparse's own errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from iterserve.core.config import (CacheConfig, ParallelConfig, SchedulerConfig, add_knob_argument,
                                   knob_fields, knobs_of)
from iterserve.core.cost_model import load_cost_model
from iterserve.errors import LabOptionsError
from iterserve.lab.api import plan_lab, simulate_plan
from iterserve.lab.cluster import CLUSTER_FIELDS, DEFAULT_REPLICAS, run_cluster_lab
from iterserve.lab.metrics import summarize
from iterserve.lab.options import (LAB_CHOICES, LAB_DEFAULTS, LAB_HELP, OPTION_DEFAULTS, PRESETS,
                                   RENAMED, SHARED_KNOBS)
from iterserve.lab.plot import write_plot
from iterserve.lab.trace import write_trace
from iterserve.lab.workload import parse_range, read_lengths_file


# Subcommands of `iterserve lab` (name, module with register(subparsers)): `calibrate` fits
# the cost model to the real model runner; `slo` and `spec` are the SLO-admission and
# speculative-decoding experiments as commands.
LAB_SUBCOMMANDS: list[tuple[str, str]] = [("calibrate", "iterserve.lab.calibrate"),
                                          ("slo", "iterserve.lab.slo"),
                                          ("spec", "iterserve.lab.spec")]


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "lab", help="static vs continuous batching on the real scheduler, simulated time",
        description="Run the engine's scheduler with a simulated executor and compare "
                    "static and continuous batching (steps, utilisation, latency).")
    w = p.add_argument_group("workload")
    D = OPTION_DEFAULTS
    w.add_argument("--preset", choices=tuple(PRESETS),
                   help="start from a named option set (the other flags override it): "
                        + "; ".join(f"{k}: {v['description']}"
                                    for k, v in PRESETS.items()).replace("%", "%%"))
    w.add_argument("--requests", type=int, help=f"number of requests (default {D['requests']})")
    w.add_argument("--seed", type=int, help="random seed of the draw (default: the reference seed)")
    w.add_argument("--short-frac", type=float,
                   help=f"share of short answers (default {D['short_frac']})")
    w.add_argument("--short", metavar="MIN-MAX",
                   help="short answer lengths (default {}-{})".format(*D["short"]))
    w.add_argument("--long", metavar="MIN-MAX",
                   help="long answer lengths (default {}-{})".format(*D["long"]))
    w.add_argument("--lengths", metavar="FILE",
                   help="one output length per line instead of drawing them")
    w.add_argument("--arrival-rate", type=float, metavar="R",
                   help="Poisson arrivals, requests per step (default: all at step 0)")
    s = p.add_argument_group("scheduler (prefill on)")
    s.add_argument("--prompt-len", metavar="MIN-MAX",
                   help="prompt lengths; turns prefill on (default: prefill ignored)")
    s.add_argument("--priority-frac", type=float,
                   help="share of urgent requests under --scheduling-policy priority "
                        "(default 0.2)")
    s.add_argument("--mix", choices=("reference", "longprompt"),
                   help="longprompt: 10%% of the prompts 1500-2000 tokens among short chats "
                        "(--prompt-len, default 20-100); turns prefill on")
    s.add_argument("--long-prompt-frac", type=float,
                   help="--mix longprompt: share of the long prompts (default 0.1)")
    _add_knob_arguments(w, s)
    # The lab's former flags: hidden, and an error that names the new flag.
    for old, new in RENAMED.items():
        p.add_argument("--" + old.replace("_", "-"), nargs="?", help=argparse.SUPPRESS,
                       action=_Renamed, new="--" + new.replace("_", "-"))
    s.add_argument("--arrival-rate-s", type=float, metavar="R",
                   help="Poisson arrivals, requests per simulated second (instead of per "
                        "step; for SLO experiments)")
    s.add_argument("--speculative-config", metavar="JSON",
                   help="speculative decoding, the engine's JSON (e.g. '{\"method\": "
                        "\"ngram\", \"num_speculative_tokens\": 4}'); the lab proposes "
                        "num_speculative_tokens drafts a step and accepts them at "
                        "--spec-acceptance (or a synthetic config's acceptance_rates)")
    s.add_argument("--spec-acceptance", metavar="A|P1,P2,...",
                   help="the workload's acceptance: one number a (draft j accepted with "
                        "a^j) or one probability per draft position")
    _add_cluster_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--cost-model", metavar="FILE|NAME",
                   help="step-time model: a JSON file, or a shipped name (smollm2-cpu: fitted to the "
                        "bundled model on the reference CPU; default_cost_model)")
    o.add_argument("--json", action="store_true", help="print the result as JSON")
    o.add_argument("--per-request", action="store_true",
                   help="include per-request records and the timeline (implies --json)")
    o.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace")
    o.add_argument("--plot", metavar="FILE.png", help="write a slot-occupancy (Gantt) plot")
    v = p.add_argument_group("serve")
    v.add_argument("--serve", action="store_true", help="serve the /lab page (no model)")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    if LAB_SUBCOMMANDS:
        import importlib

        sub = p.add_subparsers(dest="lab_command", metavar="LAB_COMMAND")
        for _name, module in LAB_SUBCOMMANDS:
            importlib.import_module(module).register(sub)
    p.set_defaults(func=run)
    return p


# Shared knobs whose flag sits with the workload's; the rest go with the scheduler's.
_WORKLOAD_KNOBS = ("batching", "max_num_seqs")
_METAVARS = {"request_timeout": "STEPS", "queue_timeout": "STEPS", "max_queued_requests": "N"}


def _add_knob_arguments(workload, scheduler) -> None:
    """A flag for every engine knob the lab takes (lab/options.py SHARED_KNOBS), spelled as
    `iterserve serve` spells it and generated from core/config.py; the help gives the
    lab's default, its units and its extra choices where they differ."""
    from dataclasses import replace

    schema = knobs_of(SchedulerConfig, CacheConfig)
    for name in SHARED_KNOBS:
        k = schema[name][1]
        if name in LAB_CHOICES:
            k = replace(k, kind=str, choices_=LAB_CHOICES[name])
        k = replace(k, help=LAB_HELP.get(name, k.help), metavar=_METAVARS.get(name, k.metavar))
        default = OPTION_DEFAULTS[name]
        text = (f"default {default}" if default is not None
                else "default: from the workload" if name in LAB_DEFAULTS else "")
        add_knob_argument(workload if name in _WORKLOAD_KNOBS else scheduler, name, k, None,
                          text)


# Cluster flags (lab/cluster.py): any of them makes the run a cluster run.
CLUSTER_ARGS = ("data_parallel_size", "router", "prefix_groups", "prefix_len", "prefix_zipf",
                "search", "search_p99_ttft_ms", "search_max_replicas")


def _add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """`--replicas N --router POLICY ...`: the knobs' flags generated from ParallelConfig
    (`--replicas` is the lab's spelling of --data-parallel-size / -dp, which work too)."""
    from dataclasses import replace

    c = p.add_argument_group(
        "cluster (N replicas behind the server's router; any of these makes a cluster run)")
    for name, _default, k in knob_fields(ParallelConfig):
        if name == "data_parallel_size":
            add_knob_argument(c, name, replace(k, flag="--replicas"), None,
                              f"default {DEFAULT_REPLICAS}")
            c.add_argument("--data-parallel-size", dest=name, type=int, help=argparse.SUPPRESS)
        elif name == "router":
            add_knob_argument(c, name, k, None, f"default {k.kind.LEAST_LOADED.value}")

    def desc(name: str) -> str:
        return CLUSTER_FIELDS[name][1].description

    c.add_argument("--prefix-groups", type=int, metavar="G", help=desc("prefix_groups"))
    c.add_argument("--prefix-len", type=int, metavar="TOKENS", help=desc("prefix_len"))
    c.add_argument("--prefix-zipf", type=float, metavar="S", help=desc("prefix_zipf"))
    c.add_argument("--search", choices=("rate", "replicas"), help=desc("search"))
    c.add_argument("--search-p99-ttft-ms", type=float, metavar="MS",
                   help=desc("search_p99_ttft_ms"))
    c.add_argument("--search-max-replicas", type=int, metavar="N",
                   help=desc("search_max_replicas") + " (default 64)")


class _Renamed(argparse.Action):
    """A removed flag: exit 2 with "--slots: renamed to --max-num-seqs"."""

    def __init__(self, option_strings, dest, new: str, **kw):
        super().__init__(option_strings, dest, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: renamed to {self.new}")


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """CLI flags -> run_lab options (files are read here; values are checked by run_lab)."""
    opts: dict[str, Any] = {"batching": args.batching or (None if args.preset else "both"),
                            "preset": args.preset}
    for name in (*SHARED_KNOBS, "requests", "seed", "short_frac", "arrival_rate",
                 "priority_frac", "mix", "long_prompt_frac", "arrival_rate_s"):
        if name == "batching":
            continue
        value = getattr(args, name)
        if value is not None:
            opts[name] = value
    for name in ("short", "long", "prompt_len"):
        value = getattr(args, name)
        if value is not None:
            opts[name] = list(parse_range(value, "--" + name.replace("_", "-")))
    if args.lengths is not None:
        opts["lengths"] = list(read_lengths_file(args.lengths))
    if args.cost_model is not None:
        opts["cost_model"] = load_cost_model(args.cost_model)
    if args.per_request:
        opts["per_request"] = True
    if args.speculative_config is not None:
        opts["speculative_config"] = args.speculative_config     # JSON text, parsed by the lab
    if args.spec_acceptance is not None:
        opts["spec_acceptance"] = _acceptance(args.spec_acceptance)
    return opts


def _acceptance(text: str) -> float | list[float]:
    """--spec-acceptance: one number or a comma list (checked by the lab's options)."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"spec_acceptance: expected numbers, got {text!r}") from None
    return values[0] if len(values) == 1 else values


def run(args: argparse.Namespace) -> int:
    if args.serve:               # the server's handler, set by iterserve/cli.py
        return args.serve_lab_page(args.host, args.port)

    if any(getattr(args, name, None) is not None for name in CLUSTER_ARGS):
        return run_cluster(args)
    try:
        plan = plan_lab(options_from_args(args))
    except (LabOptionsError, ValueError) as e:     # WorkloadError, CostModelError too
        print(f"iterserve lab: error: {e}", file=sys.stderr)
        return 2
    results = simulate_plan(plan, record=bool(args.trace or args.plot))
    summaries = {m: summarize(r, per_request=plan.per_request) for m, r in results.items()}
    try:
        if args.trace:
            write_trace(results, args.trace)
        if args.plot:
            write_plot(results, summaries, args.plot)
    except OSError as e:
        print(f"iterserve lab: error: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    if args.json or args.per_request:
        json.dump(summaries, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_report(plan, summaries))
    return 0


def run_cluster(args: argparse.Namespace) -> int:
    """`iterserve lab --replicas N --router POLICY ...`: the cluster lab (lab/cluster.py)."""
    for flag, value in (("--trace", args.trace), ("--plot", args.plot),
                        ("--per-request", args.per_request or None)):
        if value is not None:
            print(f"iterserve lab: error: {flag} is not available in cluster runs "
                  "(--replicas / --router)", file=sys.stderr)
            return 2
    try:
        opts = options_from_args(args)
        if opts.get("batching") == "both":           # the lab's CLI default: one mode here
            opts["batching"] = "continuous"
        for name in CLUSTER_ARGS:
            value = getattr(args, name)
            if value is not None:
                opts[name] = value
        result = run_cluster_lab(opts)
    except (LabOptionsError, ValueError) as e:
        print(f"iterserve lab: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_cluster_report(result))
    return 0


def format_cluster_report(r: dict[str, Any]) -> str:
    """The cluster run as text: the cluster's figures, one row per replica, the search."""
    wl = r["workload"]
    rate = (f"Poisson {wl['arrival_rate_s']:g} requests/s" if wl["arrival_rate_s"]
            else "all at t=0")
    prefix = (f", {wl['prefix_groups']} shared prefixes of {wl['prefix_len']} tokens"
              if wl["prefix_groups"] else "")
    lines = [f"{r['requests']:,} requests ({rate}{prefix}) over {r['replicas']} replicas of "
             f"{r['slots']} slots, router {r['router']}", ""]
    rows = [("simulated time (s)", "time_s", "{:,.2f}"),
            ("throughput (tokens/s)", "throughput_tokens_per_s", "{:,.1f}"),
            ("requests/s", "requests_per_s", "{:,.2f}"),
            ("p50 / p99 TTFT (s)", ("p50_ttft_s", "p99_ttft_s"), "{:.3f}"),
            ("p50 / p99 ITL (s)", ("p50_itl_s", "p99_itl_s"), "{:.4f}"),
            ("p50 / p99 latency (s)", ("p50_latency_s", "p99_latency_s"), "{:.2f}"),
            ("prefix-cache hit rate", "prefix_cache_hit_rate", "{:.1%}"),
            ("load imbalance (max/mean)", "load_imbalance", "{:.2f}"),
            ("refused", "refused", "{:,}"), ("preemptions", "preemptions", "{:,}"),
            ("goodput (requests/s)", "goodput_rps", "{:,.2f}")]
    for label, key, fmt in rows:
        keys = key if isinstance(key, tuple) else (key,)
        if all(k in r for k in keys):
            lines.append(f"{label:28}" + " / ".join(fmt.format(r[k]) for k in keys))
    rs = r["router_stats"]
    if r["router"] == "prefix_aware":
        lines.append(f"{'router':28}{rs['prefix_routed']:,} to their prefix's replica, "
                     f"{rs['fallbacks']:,} fell back to load")
    lines += ["", f"{'replica':>8}{'requests':>10}{'busy':>8}{'slot util':>11}"
                  f"{'hit rate':>10}{'preempt':>9}"]
    for p in r["per_replica"]:
        lines.append(f"{p['replica']:>8}{p['requests']:>10,}{p['busy_frac']:>8.1%}"
                     f"{p['slot_utilization']:>11.1%}{p['prefix_cache_hit_rate']:>10.1%}"
                     f"{p['preemptions']:>9,}")
    s = r.get("search")
    if s:
        lines.append("")
        if s["kind"] == "rate":
            best = s["max_rate_rps"]
            lines.append(
                f"highest rate with p99 TTFT <= {s['p99_ttft_ms']:g} ms on {r['replicas']} "
                f"replicas: " + (f"{best:,.2f} requests/s" if best else "none (even a "
                                 "trickle misses it)")
                + ("" if s["bounded"] else " (or more: the search stopped widening)")
                + f"; burst capacity {s['capacity_rps']:,.2f} requests/s")
        else:
            n = s["replicas"]
            lines.append(f"replicas for {wl['arrival_rate_s']:g} requests/s at p99 TTFT <= "
                         f"{s['p99_ttft_ms']:g} ms: " + (str(n) if n else
                                                          f"more than {s['max_replicas']}"))
        for row in s["runs"]:
            what = (f"rate {row['arrival_rate_s']:8.2f}" if "arrival_rate_s" in row
                    else f"replicas {row['replicas']:4}")
            lines.append(f"  {what}: p99 TTFT {row.get('p99_ttft_s', 0):.3f} s, refused "
                         f"{row['refused']}, {'meets' if row['meets'] else 'misses'}")
    return "\n".join(lines)


def _fmt(value: Any, kind: str) -> str:
    if kind == "int":
        return f"{value:,}"
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "s":
        return f"{value:,.2f}"
    return f"{value:,.1f}"


ROWS = [  # (label, key, format)
    ("steps", "steps", "int"),
    ("slot utilisation", "utilization", "pct"),
    ("mean latency (steps)", "mean_latency", "f"),
    ("p50 latency (steps)", "p50_latency", "f"),
    ("p99 latency (steps)", "p99_latency", "f"),
    ("mean TTFT (steps)", "mean_ttft", "f"),
    ("p99 TTFT (steps)", "p99_ttft", "f"),
    ("mean ITL (steps)", "mean_itl", "f"),
    ("p99 ITL (steps)", "p99_itl", "f"),
    ("preemptions", "preemptions", "int"),
    ("simulated time (s)", "time_s", "s"),
    ("throughput (tokens/s)", "throughput_tokens_per_s", "f"),
    ("refused (SLO)", "refused", "int"),
    ("refused (queue full)", "refused_queue_full", "int"),
    ("timed out", "timed_out", "int"),
    ("met both SLOs", "slo_met", "int"),
    ("goodput (requests/s)", "goodput_rps", "s"),
]


def format_report(plan, summaries: dict[str, dict[str, Any]]) -> str:
    """The side-by-side table the reference case prints."""
    wl = plan.workload
    first = next(iter(summaries.values()))
    if wl.lengths is not None:
        mix = f"{first['requests']} requests with given lengths"
    else:
        mix = (f"{first['requests']} requests ({wl.short_frac:.0%} short "
               f"{wl.short[0]}-{wl.short[1]}, {1 - wl.short_frac:.0%} long "
               f"{wl.long[0]}-{wl.long[1]} tokens), seed {wl.seed}")
    arrivals = ("all at step 0" if wl.arrival_rate is None
                else f"Poisson arrivals, {wl.arrival_rate:g} per step")
    if wl.arrival_rate_s is not None:
        arrivals = f"Poisson arrivals, {wl.arrival_rate_s:g} per simulated second"
    prefill = ("prefill ignored" if wl.prompt_len is None
               else f"prompts {wl.prompt_len[0]}-{wl.prompt_len[1]} tokens")
    if wl.long_prompt_frac and wl.long_prompt:
        prefill += (f", {wl.long_prompt_frac:.0%} long prompts "
                    f"{wl.long_prompt[0]}-{wl.long_prompt[1]} tokens")
    lines = [f"{mix}; {first['slots']} slots; {arrivals}; {prefill}", ""]
    modes = list(summaries)
    lines.append(f"{'':24}" + "".join(f"{m:>14}" for m in modes))
    for label, key, kind in ROWS:
        if all(key in summaries[m] for m in modes):
            lines.append(f"{label:24}" + "".join(
                f"{_fmt(summaries[m][key], kind):>14}" for m in modes))
    for m in modes:
        sd = summaries[m].get("spec_decoding")
        if sd is not None:
            lines.append(f"speculative decoding ({m}): {sd['num_drafts']} verifications, "
                         f"{sd['num_accepted_tokens']} of {sd['num_draft_tokens']} drafts "
                         f"accepted, {sd['mean_acceptance_length']:.2f} tokens a "
                         "verification")
    if len(modes) == 2:
        st, co = summaries["static"], summaries["continuous"]
        if co["steps"] and co["mean_latency"]:
            lines += ["", f"speed-up of continuous batching: {st['steps'] / co['steps']:.2f}x "
                          f"fewer steps, {st['mean_latency'] / co['mean_latency']:.2f}x lower "
                          "mean latency"]
    return "\n".join(lines)
