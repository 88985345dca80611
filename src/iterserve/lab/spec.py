"""Speculative decoding in the lab: at which batch sizes and acceptance rates it pays.

A verification prices its drafts as decode rows (the cost model's per-token, per-row and
K/V terms); at batch 1 a step is mostly its fixed cost (the weights read), so drafts that
are often accepted are nearly free, and as the batch grows each row is a larger share of
the step. `sweep` runs the same workload at each slot count without speculation and with
it at each acceptance a (draft j accepted with a^j: each draft given the one before it with
a), twice: with the engine's adaptive plan (core/spec_decode/adaptive.py: drafts only where
their expected tokens beat their cost) and with every proposal verified (`adaptive`:
false), and reports tokens per simulated second as a gain over no speculation. The engine
is checked against these gains by benchmarks/lab_vs_engine_spec.py (same acceptance drawn
by the engine's `synthetic` method).

Everything here is `run_lab` with options, so the page and `POST /v1/lab/run` can run the
same points.
"""

from __future__ import annotations

from typing import Any

from iterserve.core.cost_model import load_cost_model
from iterserve.errors import CostModelError, LabOptionsError
from iterserve.lab.api import run_lab

# The bench `mix` shape (prompts 8-40 tokens, 80% short answers, 20% long) on the shipped
# fit of the bundled model.
BASE: dict[str, Any] = {"batching": "continuous", "requests": 48, "prompt_len": [8, 40],
                        "cost_model": "smollm2-cpu"}
SLOTS = (1, 2, 4, 8, 16)
ACCEPTANCE = (0.3, 0.5, 0.7, 0.9)
K = 4


def _throughput(opts: dict[str, Any]) -> tuple[float, dict | None]:
    r = run_lab(opts)["continuous"]
    return r["throughput_tokens_per_s"], r.get("spec_decoding")


def sweep(options: dict[str, Any] | None = None, slots=SLOTS, acceptance=ACCEPTANCE,
          k: int = K) -> dict[str, Any]:
    """{"rows": [{slots, acceptance, off / adaptive / every-draft tokens/s, gains, mean
    acceptance length}], ...} for each slot count x acceptance."""
    base = {**BASE, **(options or {})}
    if isinstance(base.get("cost_model"), str):
        base["cost_model"] = load_cost_model(base["cost_model"])
    rows = []
    for n in slots:
        off, _ = _throughput({**base, "max_num_seqs": n})
        for a in acceptance:
            row: dict[str, Any] = {"slots": n, "acceptance": a, "off_tok_s": off}
            for name, adaptive in (("adaptive", True), ("every_draft", False)):
                spec = {"method": "ngram", "num_speculative_tokens": k, "adaptive": adaptive}
                tps, stats = _throughput({**base, "max_num_seqs": n,
                                          "speculative_config": spec, "spec_acceptance": a})
                row[f"{name}_tok_s"] = tps
                row[f"{name}_gain"] = tps / off if off > 0 else 0.0
                row[f"{name}_mean_acceptance_length"] = (
                    stats["mean_acceptance_length"] if stats and stats["num_drafts"] else None)
                row[f"{name}_draft_tokens"] = stats["num_draft_tokens"] if stats else 0
            rows.append(row)
    return {"k": k, "requests": base["requests"], "rows": rows}


def register(subparsers):
    p = subparsers.add_parser(
        "spec", help="speculative decoding's gain by batch size and acceptance rate",
        description="Simulate the bench mix without speculation and with k drafts a step "
                    "at each acceptance a (draft j accepted with a^j), adaptive and with "
                    "every draft verified, at each slot count: tokens per simulated second "
                    "as a gain over no speculation.")
    p.add_argument("--slots", default=",".join(map(str, SLOTS)),
                   help="max_num_seqs values, comma-separated")
    p.add_argument("--acceptance", default=",".join(f"{a:g}" for a in ACCEPTANCE),
                   help="per-draft acceptance values in (0, 1], comma-separated")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=K)
    p.add_argument("--requests", type=int, default=BASE["requests"])
    p.add_argument("--seed", type=int, default=None, help="workload seed (default: the lab's)")
    p.add_argument("--cost-model", default=BASE["cost_model"], metavar="FILE|NAME")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
    return p


def _floats(text: str, name: str, kind=float) -> tuple:
    try:
        values = tuple(kind(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"{name} must be positive, got {text!r}")
    return values


def run(args) -> int:
    import json
    import sys

    opts: dict[str, Any] = {"requests": args.requests, "cost_model": args.cost_model}
    if args.seed is not None:
        opts["seed"] = args.seed
    try:
        slots = _floats(args.slots, "--slots", int)
        acceptance = _floats(args.acceptance, "--acceptance")
        if any(a > 1 for a in acceptance):
            raise ValueError(f"--acceptance values are probabilities, got {args.acceptance!r}")
        result = sweep(opts, slots, acceptance, args.k)
    except (LabOptionsError, CostModelError, ValueError) as e:
        print(f"iterserve lab spec: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
        return 0
    print(f"k = {result['k']} drafts a step, {result['requests']} requests of the bench mix; "
          "gain = tokens/s over no speculation (> 1: it pays)")
    print(f"{'slots':>5} {'accept':>6} {'off tok/s':>10} {'adaptive':>9} {'every draft':>12} "
          f"{'tokens/verify':>13}")
    for r in result["rows"]:
        mal = r["adaptive_mean_acceptance_length"]
        print(f"{r['slots']:>5} {r['acceptance']:>6g} {r['off_tok_s']:>10.1f} "
              f"{r['adaptive_gain']:>8.2f}x {r['every_draft_gain']:>11.2f}x "
              f"{'-' if mal is None else f'{mal:.2f}':>13}")
    return 0
