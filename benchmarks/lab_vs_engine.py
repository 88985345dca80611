"""Does the lab predict the real engine? Wall time of the offline engine vs the lab's seconds.

For each workload the real engine (iterserve.engine, continuous batching, max_num_seqs 8 and
every other knob at its default) serves the requests, and the lab simulates the same
requests (same prompt lengths as the engine's tokenizer counts them, same output lengths,
same arrival times) on the same scheduler knobs, turning its steps into seconds with a cost
model (default: the shipped fit `smollm2-cpu`, see `iterserve lab calibrate`).

- ``mix``: 48 requests at t=0 through `LLM.generate` (the offline API).
- ``poisson``: the same mix arriving as a Poisson process (``--rate`` requests/s, default
  0.5, about half of what 8 slots serve on this CPU). Offline, no server: a small driver adds
  each request to the engine once the wall clock passes its arrival time, steps the engine
  while it has work and sleeps until the next arrival when it has none. The HTTP server
  would add its own overheads, which the lab does not model. The lab places each arrival at
  the first step that starts at or after it on the lab's own clock; since that clock depends
  on the arrivals, it iterates to a fixed point (reported as `arrival_iterations`).

Reported per workload: real wall time (first arrival to last finish, model load and a
warm-up request excluded), predicted time, relative error (the target is within 10%), steps
of both, and where the difference comes from: the cost model's prediction summed over the
engine's *own* steps vs the time ModelRunner.execute took (the fit error on real batches),
and the wall time outside execute (scheduling, detokenisation, output building), which the
cost model, fitted to execute alone, does not include.

    .venv/bin/python benchmarks/lab_vs_engine.py [--cost-model smollm2-cpu] [--out FILE]
        [--workloads mix,poisson] [--rate 0.5] [--num-requests 48] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.bench.client import machine_info
from iterserve.bench.workloads import Workload, build_workload
from iterserve.lab.cost_model import CostModel, load_cost_model
from iterserve.lab.simulator import SimResult, SimSettings, simulate
from iterserve.lab.workload import RequestSpec

MAX_NUM_SEQS = 8


class StepRecorder:
    """Wraps the engine's executor: per forward step, the cost model's inputs and the time
    `execute` took (the same counting rules as the lab's simulator)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.steps: list[tuple[int, int, int, int, float]] = []

    def execute(self, output):
        t = time.perf_counter()
        try:
            return self.inner.execute(output)
        finally:
            dt = time.perf_counter() - t
            sched = output.num_scheduled_tokens
            if sched:
                data = output.scheduled_new_reqs + output.scheduled_cached_reqs
                tokens = sum(sched.values())
                kv = sum(d.num_computed_tokens + sched[d.req_id] for d in data)
                # A prefill chunk: more than one token, or inside the prompt (the runner's
                # own state knows the prompt length of every request it holds).
                plen = {rid: len(st.prompt_token_ids)
                        for rid, st in getattr(self.inner, "requests", {}).items()}
                prefill = sum(sched[d.req_id] for d in data if sched[d.req_id] > 1
                              or d.num_computed_tokens < plen.get(d.req_id, 0))
                self.steps.append((tokens, len(sched), kv, prefill, dt))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _params(w: Workload):
    from iterserve.core.request import SamplingParams

    return [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            for r in w.requests]


def run_engine(engine, w: Workload) -> dict:
    """Serve `w` on the real engine; arrivals by wall clock (all at once for t=0 workloads)."""
    from iterserve.engine.llm import LLM

    rec = StepRecorder(engine.executor)
    engine.executor = rec
    params = _params(w)
    prompts = [r.prompt for r in w.requests]
    try:
        if all(r.arrival_s == 0 for r in w.requests):
            t0 = time.perf_counter()
            outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
        else:
            wall, generated = _drive_by_wall_clock(engine, w, prompts, params)
    finally:
        engine.executor = rec.inner
    if generated != w.total_output_tokens:
        raise RuntimeError(f"engine generated {generated} tokens, expected "
                           f"{w.total_output_tokens} (ignore_eos not honoured?)")
    return {"wall_s": wall, "steps": rec.steps}


def _drive_by_wall_clock(engine, w: Workload, prompts, params) -> tuple[float, int]:
    order = sorted(range(len(w.requests)), key=lambda i: w.requests[i].arrival_s)
    nxt, generated, last_finish = 0, 0, 0.0
    t0 = time.perf_counter()
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(order) and w.requests[order[nxt]].arrival_s <= now:
            i = order[nxt]
            engine.add_request(f"lve-{w.name}-{i}", prompts[i], params[i])
            nxt += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
                    last_finish = time.perf_counter() - t0
        else:
            time.sleep(max(0.0, w.requests[order[nxt]].arrival_s - now))
    return last_finish, generated


def lab_settings(engine) -> SimSettings:
    """The engine's own scheduler and KV-pool knobs, as the lab's settings."""
    sc, cc = engine.scheduler_config, engine.cache_config
    return SimSettings(sc, cc, prefill_ignored=False)


def _arrival_steps(arrivals_s: list[float], res: SimResult | None, cost: CostModel) -> list[int]:
    """First lab step starting at or after each arrival (past the end: idle steps)."""
    if res is None:
        return [0] * len(arrivals_s)
    starts = np.asarray(res.step_start_s)
    out = []
    for a in arrivals_s:
        s = int(np.searchsorted(starts, a - 1e-12, side="left"))
        if s >= len(starts):
            idle = cost.idle_step_s or cost.c0 or 1e-3
            s = len(starts) - 1 + int(np.ceil((a - starts[-1]) / idle))
        out.append(s)
    return out


def run_lab_seconds(w: Workload, prompt_lens: list[int], settings: SimSettings,
                    cost: CostModel, max_iter: int = 50) -> dict:
    """Simulate `w` and return its predicted time; arrivals in seconds are mapped onto lab
    steps by iterating to a fixed point (each pass maps them with the previous pass's clock)."""
    arrivals_s = [r.arrival_s for r in w.requests]
    res, steps_prev, iterations = None, None, 0
    for iterations in range(1, max_iter + 1):
        steps = _arrival_steps(arrivals_s, res, cost)
        if steps == steps_prev:
            break
        specs = sorted((RequestSpec(i, steps[i], prompt_lens[i], r.max_tokens,
                                    r.kind == "long", 0)
                        for i, r in enumerate(w.requests)), key=lambda s: (s.arrival, s.index))
        res = simulate(specs, settings, cost, record=True)
        steps_prev = steps
    converged = steps == steps_prev
    # Steps that ran something (idle steps waiting for an arrival hold no slot).
    forward = int(np.count_nonzero(np.asarray(res.timeline["running"]) > 0))
    return {"time_s": float(res.step_start_s[-1]), "steps": res.steps,
            "forward_steps": forward, "arrival_iterations": iterations,
            "converged": converged, "result": res}


def compare(engine, w: Workload, cost: CostModel) -> dict:
    prompt_lens = [len(engine.tokenize_prompt(r.prompt)) for r in w.requests]
    load_before = machine_info()["loadavg"]
    real = run_engine(engine, w)
    load_after = machine_info()["loadavg"]
    lab = run_lab_seconds(w, prompt_lens, lab_settings(engine), cost)
    res: SimResult = lab["result"]
    steps = real["steps"]
    exec_s = sum(s[4] for s in steps)
    fit_on_real = sum(cost.step_time(t, n, kv, pf) for t, n, kv, pf, _ in steps)
    err = (lab["time_s"] - real["wall_s"]) / real["wall_s"]
    return {
        "workload": w.summary(),
        "real_wall_s": round(real["wall_s"], 3),
        "predicted_s": round(lab["time_s"], 3),
        "rel_error": round(err, 4),
        "within_10pct": abs(err) <= 0.10,
        "real_steps": len(steps),
        "lab_steps": lab["forward_steps"],
        "lab_idle_steps": res.steps - lab["forward_steps"],
        "lab_busy_slot_steps": res.busy_slot_steps,
        "real_busy_slot_steps": sum(s[1] for s in steps),
        "arrival_iterations": lab["arrival_iterations"],
        "arrivals_converged": lab["converged"],
        "breakdown": {
            "real_execute_s": round(exec_s, 3),
            "real_outside_execute_s": round(real["wall_s"] - exec_s, 3),
            "cost_model_on_real_steps_s": round(fit_on_real, 3),
            "fit_error_on_real_steps": round((fit_on_real - exec_s) / exec_s, 4),
            "overhead_per_step_ms": round(1e3 * (real["wall_s"] - exec_s) / max(1, len(steps)), 3),
        },
        "load_average_before": load_before, "load_average_after": load_after,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    ap.add_argument("--cost-model", default="smollm2-cpu",
                    help="cost model file or shipped name (default smollm2-cpu)")
    ap.add_argument("--workloads", default="mix,poisson")
    ap.add_argument("--rate", type=float, default=0.5, help="poisson arrivals, requests/s")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON report here too")
    args = ap.parse_args(argv)

    from iterserve.engine.args import EngineArgs
    from iterserve.engine.llm import LLM
    from iterserve.engine.llm_engine import LLMEngine

    cost = load_cost_model(args.cost_model)
    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, max_num_seqs=MAX_NUM_SEQS))
    warm = build_workload("mix", seed=args.seed, num_requests=1)
    LLM.from_engine(engine).generate([warm.requests[0].prompt], _params(warm), use_tqdm=False)

    rows = []
    for name in [x.strip() for x in args.workloads.split(",") if x.strip()]:
        rate = args.rate if name == "poisson" else None
        w = build_workload(name, seed=args.seed, rate=rate, num_requests=args.num_requests)
        row = compare(engine, w, cost)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "workload"}), file=sys.stderr,
              flush=True)
    report = {"kind": "lab_vs_engine", "model": args.model or "default",
              "cost_model": args.cost_model, "cost_model_description": cost.description,
              "max_num_seqs": MAX_NUM_SEQS, "engine_knobs": "EngineArgs defaults otherwise",
              "machine": machine_info(), "torch_threads": _threads(), "results": rows}
    print(f"\n{'workload':10} {'real s':>8} {'lab s':>8} {'error':>7} {'steps':>6} "
          f"{'lab steps':>9} {'exec s':>7} {'fit on real':>11} {'overhead/step':>13}")
    for r in rows:
        b = r["breakdown"]
        print(f"{r['workload']['name']:10} {r['real_wall_s']:>8.2f} {r['predicted_s']:>8.2f} "
              f"{r['rel_error']:>+7.1%} {r['real_steps']:>6} {r['lab_steps']:>9} "
              f"{b['real_execute_s']:>7.2f} {b['fit_error_on_real_steps']:>+11.1%} "
              f"{b['overhead_per_step_ms']:>11.2f}ms")
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _threads() -> int:
    import torch
    return torch.get_num_threads()


if __name__ == "__main__":
    sys.exit(main())
