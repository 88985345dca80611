"""Speculative decoding on the `edit` workload, iterserve beside llama-server, one run.

Why: speculation pays where the answer repeats the context (an agent quoting a file back
with an edit) and at small batches (a step is bound by reading the weights, so verifying a
few proposed tokens costs little more than decoding one). Its gain is a ratio to the same
engine without it, and the peer that users compare against has n-gram modes of its own, so
every arm runs here on the same file, the same workload and the same client
(`iterserve.bench.client.run_workload`, streaming chat completions, greedy, ignore_eos):

- iterserve: speculation off, `ngram` (prompt lookup, k tokens), `suffix`;
- llama-server (benchmarks/peers/llama_server.py builds it): `--spec-type none`,
  `ngram-mod` and `ngram-simple` (its own defaults for each mode's sizes).

Each arm is its own server, started alone, warmed up with one request, then given the
workload at each concurrency (`--slots`: the server gets that many slots and the client
keeps that many requests in flight). Reported: output tokens/s over the run, the median
time per output token after the first (TPOT: a step's several tokens arrive together), and
each arm's ratio to its engine's arm without speculation and to llama-server's without.

    python benchmarks/spec_vs_llama_server.py [--slots 1,8] [--num-requests 8] [-k 4]
        [--repeats 3] [--temperature 0.8] [--no-llama]
        [--out benchmarks/results/spec-edit-vs-llama-server.json]

`--repeats N` runs the arms N times in rounds (off, ngram, suffix, off, ...) and reports each
arm's median gain over its own round's off: the machines here drift by 10-20% within an hour,
and a round's arms share the drift. `--temperature T` samples every answer (0: greedy); with
`--workload mix` that is the chat case, where a small model's sampled answers do not loop
and most drafts are rejected, so what it shows is whether the adaptive plan keeps
speculation from costing anything.

`--synthetic P1,P2,...` measures the cost of verification instead, on a model whose drafts
would never be accepted (random weights of a real shape, `--model FILE`): draft j is
accepted with the unconditional probability Pj whatever the model computes, in both
engines (iterserve's `synthetic` method; llama-server's `--spec-synth-rates`). The output
is then not the model's; the time a step takes is a real verification's. The arms:

- iterserve: off, `synthetic` (adaptive: drafts only where they pay), and `synthetic` with
  every draft verified (`adaptive: false`), k = the number of rates;
- llama-server: off, `ngram-mod` with the rates (its drafts come from n-grams of the
  context, so it verifies only on steps where one matched), and `draft-simple` with the
  rates and `--draft-model` (default the bundled SmolLM2-135M, which shares the SmolLM2
  vocabulary), which drafts on every step but runs the draft model for it.

Each arm's verifications and draft tokens are read from the server's /metrics after the
run (vLLM's names on iterserve, llamacpp:spec_decode_* on llama-server), so the report says
how many of the steps verified drafts on each side.

    python benchmarks/spec_vs_llama_server.py --synthetic 0.8,0.64,0.51,0.41 --slots 1,4 \
        --model ~/.cache/iterserve-models/smollm2-1.7b/smollm2-1.7b.blocks-Q4_K_M.gguf \
        --workload mix --num-requests 8 --out benchmarks/results/spec-synthetic-1.7b.json

`--acceptance A1,A2,... -k K` runs a grid instead of one set of rates: for each a, draft j of
K accepted with a^j (the geometric model the adaptive plan assumes), each a its own pair of
arms beside one arm without speculation per slot count; with `--slots 1,4,8` that is the
table of gain against acceptance and batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from iterserve.bench.client import ClientOptions, machine_info, run_workload  # noqa: E402
from iterserve.bench.workloads import build_workload  # noqa: E402
from run_mix import _free_port, _stop, _wait_healthy  # noqa: E402


def iterserve_arms(k: int) -> list[tuple[str, list[str]]]:
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
             "prompt_lookup_max": 5}
    suffix = {"method": "suffix", "num_speculative_tokens": k}
    return [("off", []),
            (f"ngram k={k}", ["--speculative-config", json.dumps(ngram)]),
            (f"suffix k={k}", ["--speculative-config", json.dumps(suffix)])]


LLAMA_ARMS = [("off", []), ("ngram-mod", ["--spec-type", "ngram-mod"]),
              ("ngram-simple", ["--spec-type", "ngram-simple"])]


def synthetic_arms(rate_sets: list[list[float]]) -> list[tuple[str, list[str]]]:
    arms = [("off", [])]
    for rates in rate_sets:
        spec = {"method": "synthetic", "acceptance_rates": rates}
        tag = _rates_tag(rates, rate_sets)
        arms += [(f"synthetic{tag}", ["--speculative-config", json.dumps(spec)]),
                 (f"synthetic{tag} every draft",
                  ["--speculative-config", json.dumps({**spec, "adaptive": False})])]
    return arms


def llama_synthetic_arms(rate_sets: list[list[float]],
                         draft: Path) -> list[tuple[str, list[str]]]:
    arms = [("off", [])]
    for rates in rate_sets:
        k, text = str(len(rates)), ",".join(f"{r:g}" for r in rates)
        tag = _rates_tag(rates, rate_sets)
        arms += [(f"ngram-mod synthetic{tag}",
                  ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", k,
                   "--spec-synth-rates", text]),
                 (f"draft-simple synthetic{tag}",
                  ["--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max", k,
                   "--spec-draft-n-min", k, "--spec-synth-rates", text])]
    return arms


def _rates_tag(rates: list[float], rate_sets: list[list[float]]) -> str:
    """The arm's label suffix: nothing for one rate set, else its first rate (a)."""
    return "" if len(rate_sets) == 1 else f" a={rates[0]:g}"


def spec_counters(url: str) -> dict:
    """Verifications and draft tokens so far, from the server's Prometheus text (iterserve:
    vLLM's spec_decode_* names; llama-server: llamacpp:spec_decode_*_total and
    n_decode_total, its forward calls that verified nothing)."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]               # labels (iterserve's model_name) dropped
        for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                    "spec_decode_num_accepted_tokens", "n_decode_total"):
            if name.split(":")[-1] in (key, key + "_total"):
                out[key] = out.get(key, 0.0) + float(value)
    return out


def run_arm(engine: str, label: str, cmd: list[str], url: str, health: str, workload,
            slots: int, log: Path, temperature: float = 0.0) -> dict:
    opts = ClientOptions(endpoint="chat", max_concurrency=slots, request_timeout_s=1800,
                         temperature=temperature)
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, url, health, 300)
            asyncio.run(run_workload(url, build_workload(workload.name, num_requests=1,
                                                         seed=99), opts))
            before = spec_counters(url)
            doc = asyncio.run(run_workload(url, workload, opts))
            after = spec_counters(url)
        finally:
            _stop(proc)
    s = doc["summary"]
    counters = {k: after[k] - before.get(k, 0.0) for k in after}
    return {"engine": engine, "arm": label, "slots": slots, "temperature": temperature,
            "command": cmd[1:],
            "output_tok_per_s": s["output_throughput"],
            "median_tpot_ms": s["tpot"]["median_ms"], "failed": s["failed"],
            "spec_counters": counters, "summary": s}


def run_rounds(engine: str, arms: list[tuple[str, list[str]]], rounds: int, health: str,
               workload, slots: int, logs: Path, temperature: float, command) -> list[dict]:
    """Every arm once per round, in order (off, ..., off, ...); `command(port, extra)` is
    the server's command line for an arm's extra flags."""
    rows = []
    for rep in range(rounds):
        for label, extra in arms:
            port = _free_port()
            rows.append(run_arm(engine, label, command(port, extra), f"http://127.0.0.1:{port}",
                                health, workload, slots,
                                logs / f"{engine}-{slots}-{label}-{rep}.log", temperature)
                        | {"repeat": rep})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "summary"}),
                  flush=True)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Each row's gain over its own engine's arm without speculation in the same round and
    slot count (`vs_own_off`), and over llama-server's (`vs_llama_server_off`)."""
    for r in rows:
        same = [o for o in rows if o["slots"] == r["slots"] and o["arm"] == "off"
                and o["repeat"] == r["repeat"]]
        own = next((o for o in same if o["engine"] == r["engine"]), None)
        peer = next((o for o in same if o["engine"] == "llama-server"), None)
        if own and own["output_tok_per_s"] and r["output_tok_per_s"]:
            r["vs_own_off"] = r["output_tok_per_s"] / own["output_tok_per_s"]
        if peer and peer["output_tok_per_s"] and r["output_tok_per_s"]:
            r["vs_llama_server_off"] = r["output_tok_per_s"] / peer["output_tok_per_s"]


def arm_medians(rows: list[dict]) -> list[dict]:
    """Each (engine, slots, arm) over its repeats: the median tokens/s, and the median and
    range of its gain over the same round's arm without speculation (rounds interleave the
    arms, so a slow minute of the machine falls on one round's arms together)."""
    import statistics

    out = []
    keys = sorted({(r["engine"], r["slots"], r["arm"]) for r in rows},
                  key=lambda k: (k[1], k[0], k[2] != "off", k[2]))
    for engine, slots, arm in keys:
        mine = [r for r in rows if (r["engine"], r["slots"], r["arm"]) == (engine, slots, arm)]
        speeds = [r["output_tok_per_s"] or 0.0 for r in mine]
        m = {"engine": engine, "slots": slots, "arm": arm, "repeats": len(mine),
             "output_tok_per_s": statistics.median(speeds),
             "output_tok_per_s_range": [min(speeds), max(speeds)]}
        gains = [r["vs_own_off"] for r in mine if "vs_own_off" in r]
        if gains:
            m["vs_own_off"] = statistics.median(gains)
            m["vs_own_off_range"] = [min(gains), max(gains)]
        out.append(m)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", default="1,8")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("-k", type=int, default=4, help="iterserve's num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--model", type=Path, default=None,
                    help="GGUF file for both engines (default: the bundled model)")
    ap.add_argument("--workload", default="edit")
    rates_arg = ap.add_mutually_exclusive_group()
    rates_arg.add_argument("--synthetic", default=None, metavar="P1,P2,...",
                           help="synthetic acceptance rates for both engines (see above)")
    rates_arg.add_argument("--acceptance", default=None, metavar="A1,A2,...",
                           help="a grid of synthetic acceptances instead of --synthetic: for "
                                "each a, draft j of k (-k) accepted with probability a^j")
    ap.add_argument("--draft-model", type=Path, default=None,
                    help="llama-server's draft-simple arm with --synthetic (default: the "
                         "bundled model)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every arm this many times, interleaved (off, ngram, suffix, off, "
                         "...), and report each arm's median gain over the same round's off")
    ap.add_argument("--llama-repeats", type=int, default=None,
                    help="rounds of llama-server's arms (default: --repeats)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature for every request (0: greedy). Above 0 the "
                         "answers of a small model stop looping, so this is the chat case "
                         "where drafts are mostly rejected")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "benchmarks" / "results" / "spec-edit-vs-llama-server.json")
    args = ap.parse_args(argv)
    w = build_workload(args.workload, num_requests=args.num_requests)
    if args.acceptance:
        rate_sets = [[round(float(a) ** j, 4) for j in range(1, args.k + 1)]
                     for a in args.acceptance.split(",")]
    elif args.synthetic:
        rate_sets = [[float(x) for x in args.synthetic.split(",")]]
    else:
        rate_sets = []
    rates = rate_sets[0] if len(rate_sets) == 1 else None
    logs = Path("/tmp") / f"spec-vs-llama-{time.strftime('%Y%m%d-%H%M%S')}"
    logs.mkdir(parents=True, exist_ok=True)
    longest = max(r.prompt_len + r.max_tokens for r in w.requests)
    rows, notes = [], []
    for slots in [int(x) for x in args.slots.split(",")]:
        arms = synthetic_arms(rate_sets) if rate_sets else iterserve_arms(args.k)
        model = ["--model", str(args.model)] if args.model else []
        rows += run_rounds(
            "iterserve", arms, args.repeats, "/v1/models", w, slots, logs, args.temperature,
            lambda port, extra: [sys.executable, "-m", "iterserve.cli", "serve", *model,
                                 "--port", str(port), "--max-num-seqs", str(slots),
                                 "--log-level", "warning", *extra])
        if args.no_llama:
            continue
        try:
            import llama_server as ls
            ls.build()
        except Exception as e:          # the peer is optional; iterserve's figures stand
            notes.append(f"llama-server: not measured ({type(e).__name__}: {e})")
            args.no_llama = True
            continue
        ctx = max(1024, -(-(2 * longest + 64) // 256) * 256)
        peer_arms = (llama_synthetic_arms(rate_sets, args.draft_model or ls.default_gguf())
                     if rate_sets else LLAMA_ARMS)
        gguf = args.model or ls.default_gguf()
        rows += run_rounds(
            "llama-server", peer_arms,
            args.repeats if args.llama_repeats is None else args.llama_repeats, "/health", w,
            slots, logs, args.temperature,
            lambda port, extra: ls.command(gguf, port, slots, threads=args.threads,
                                           ctx_per_slot=ctx) + ["--metrics"] + extra)
    add_ratios(rows)
    medians = arm_medians(rows)
    best = {}
    for slots in {m["slots"] for m in medians}:
        per = {e: max((m for m in medians if m["slots"] == slots and m["engine"] == e),
                      key=lambda m: m["output_tok_per_s"], default=None)
               for e in ("iterserve", "llama-server")}
        if per["iterserve"] and per["llama-server"]:
            best[str(slots)] = {
                "iterserve": per["iterserve"]["arm"], "llama-server": per["llama-server"]["arm"],
                "ratio": per["iterserve"]["output_tok_per_s"]
                / per["llama-server"]["output_tok_per_s"]}
    name = "spec-synthetic-vs-llama-server" if rate_sets else "spec-edit-vs-llama-server"
    doc = {"benchmark": name, "model": str(args.model or "bundled"), "synthetic_rates": rates,
           "synthetic_rate_sets": rate_sets,
           "machine": machine_info(),
           "workload": w.summary(), "command": "python benchmarks/spec_vs_llama_server.py "
           + " ".join(argv if argv is not None else sys.argv[1:]),
           "temperature": args.temperature, "repeats": args.repeats,
           "best_vs_best": best, "medians": medians, "rows": rows, "notes": notes}
    args.out.write_text(json.dumps(doc, indent=1))
    for r in rows:
        print(f"{r['slots']:>2} {r['engine']:<13} {r['arm']:<13} "
              f"{r['output_tok_per_s'] or 0:8.1f} tok/s  own-off x{r.get('vs_own_off', 0):.2f}"
              f"  llama-off x{r.get('vs_llama_server_off', 0):.2f}"
              f"  verifications {r['spec_counters'].get('spec_decode_num_drafts', 0):.0f}"
              f" of draft tokens {r['spec_counters'].get('spec_decode_num_draft_tokens', 0):.0f}")
    for m in medians:
        print(f"median {m['slots']:>2} {m['engine']:<13} {m['arm']:<22} "
              f"{m['output_tok_per_s']:8.1f} tok/s  own-off x{m.get('vs_own_off', 0):.2f} "
              f"(range {m.get('vs_own_off_range', [0, 0])[0]:.2f}-"
              f"{m.get('vs_own_off_range', [0, 0])[1]:.2f})")
    print("best vs best:", json.dumps(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
