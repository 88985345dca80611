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

- the trade-off presets ``longprompt``, ``priority-flood``, ``kv-pressure`` (lab/options.py
  PRESETS): the lab plans the preset (its seeded draw of prompt lengths, output
  lengths, arrival seconds and priority classes; `--preset-requests` of them), the engine
  is built with the plan's scheduler and KV knobs and served the same requests (prompts of
  exactly that many random token ids, ignore_eos, each request's priority) by the same
  wall-clock driver, and the lab simulates the plan. The presets' arrival rates are set
  for the shipped `smollm2-cpu` fit; they are scaled by how much faster the given fit runs
  a reference step (16 decodes at 256 tokens), so each preset is at the same load factor
  on this model and machine as in the lab. Offline, no HTTP: what the server adds per
  token is not in either number (`slo_engine_tradeoffs.py` measures through HTTP).

Per workload also `residuals_by_tokens`: the fit's error on the engine's own steps by the
step's token count and kind (decode-only / with a prefill chunk), where a fit goes wrong;
`--also-cost-models A,B` predicts the same real run (mix, poisson) with other fits too, a
same-run A/B of fits (e.g. a fresh fit against the shipped one).

Reported per workload: real wall time (first arrival to last finish, model load and a
warm-up request excluded), predicted time, relative error (the target is within 10%), steps
of both, and where the difference comes from: the cost model's runner terms summed over the
engine's *own* steps vs the time ModelRunner.execute took (the fit error on real batches),
and the wall time outside execute (scheduling, detokenisation, output building) vs the
fit's serving-overhead terms over the same steps. For the presets also throughput, p99
inter-token latency and p99 TTFT (and the interactive class's p99 TTFT for priority-flood),
real and lab, with lab / real - 1 each.

    .venv/bin/python benchmarks/lab_vs_engine.py [--cost-model smollm2-cpu] [--out FILE]
        [--workloads mix,poisson,longprompt,priority-flood,kv-pressure] [--rate 0.5]
        [--num-requests 48] [--preset-requests N] [--model PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # slo_workloads, for the presets

from iterserve.bench.client import machine_info
from iterserve.bench.workloads import Workload, build_workload
from iterserve.core.cost_model import CostModel, load_cost_model
from iterserve.core.step_time import attention_pairs
from iterserve.lab.simulator import SimResult, SimSettings, simulate
from iterserve.lab.workload import RequestSpec

MAX_NUM_SEQS = 8
PRESETS = ("longprompt", "priority-flood", "kv-pressure")
# Requests per preset: each within ~1-2 min on the bundled model on a quiet 2-core machine.
PRESET_REQUESTS = {"longprompt": 24, "priority-flood": 64, "kv-pressure": 40}
REFERENCE_STEP = (16, 16, 16 * 257, 0)       # 16 decodes at 256 tokens of context


class StepRecorder:
    """Wraps the engine's executor: per forward step, the cost model's inputs and the time
    `execute` took (the same counting rules as the lab's simulator)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.steps: list[tuple[int, int, int, int, int, float]] = []

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
                chunks = [d for d in data if sched[d.req_id] > 1
                          or d.num_computed_tokens < plen.get(d.req_id, 0)]
                prefill = sum(sched[d.req_id] for d in chunks)
                pairs = sum(attention_pairs(d.num_computed_tokens, sched[d.req_id])
                            for d in chunks)
                self.steps.append((tokens, len(sched), kv, prefill, pairs, dt))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _params(w: Workload):
    from iterserve.core.request import SamplingParams

    return [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            for r in w.requests]


def run_engine(engine, w: Workload, priorities: dict[int, int] | None = None, *,
               stamps: bool = False) -> dict:
    """Serve `w` on the real engine; arrivals by wall clock (all at once for t=0 workloads,
    through LLM.generate unless `stamps`: token times wanted). `priorities`: request index
    -> priority (the engine must run policy priority)."""
    from iterserve.engine.llm import LLM

    rec = StepRecorder(engine.executor)
    engine.executor = rec
    params = _params(w)
    prompts = [r.prompt for r in w.requests]
    times = None
    try:
        if all(r.arrival_s == 0 for r in w.requests) and not priorities and not stamps:
            t0 = time.perf_counter()
            outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
        else:
            wall, generated, times = _drive_by_wall_clock(engine, w, prompts, params,
                                                          priorities or {})
    finally:
        engine.executor = rec.inner
    if generated != w.total_output_tokens:
        raise RuntimeError(f"engine generated {generated} tokens, expected "
                           f"{w.total_output_tokens} (ignore_eos not honoured?)")
    return {"wall_s": wall, "steps": rec.steps, "token_times": times}


def _drive_by_wall_clock(engine, w: Workload, prompts, params, priorities: dict[int, int]
                         ) -> tuple[float, int, dict[int, tuple[float, list[float]]]]:
    """(last finish, tokens generated, per request index (arrival, token times)): seconds
    from the driver's start, each token stamped when the step that made it returned."""
    order = sorted(range(len(w.requests)), key=lambda i: w.requests[i].arrival_s)
    nxt, generated, last_finish = 0, 0, 0.0
    index = {f"lve-{w.name}-{i}": i for i in range(len(w.requests))}
    times: dict[int, tuple[float, list[float]]] = {}
    t0 = time.perf_counter()
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(order) and w.requests[order[nxt]].arrival_s <= now:
            i = order[nxt]
            engine.add_request(f"lve-{w.name}-{i}", prompts[i], params[i],
                               priority=priorities.get(w.requests[i].index, 0))
            times[i] = (w.requests[i].arrival_s, [])
            nxt += 1
        if engine.has_unfinished_requests():
            outs = engine.step()
            t = time.perf_counter() - t0
            for out in outs:
                stamps = times[index[out.request_id]][1]
                stamps.extend([t] * len(out.outputs[0].delta_token_ids))
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
                    last_finish = t
        else:
            time.sleep(max(0.0, w.requests[order[nxt]].arrival_s - now))
    return last_finish, generated, times


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


TOKEN_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 10**9))


def step_residuals(steps, cost: CostModel) -> list[dict]:
    """The fit's error on the engine's own steps, by the step's token count (the rows its
    GEMMs ran) and kind (decode-only or with a prefill chunk): where a fit goes wrong."""
    rows = []
    for lo, hi in TOKEN_BUCKETS:
        for kind in ("decode", "mixed"):
            sel = [s for s in steps if lo <= s[0] <= hi and ((s[3] == 0) == (kind == "decode"))]
            if not sel:
                continue
            meas = sum(s[-1] for s in sel)
            pred = sum(cost.runner_time(t, n, kv, pf, at) for t, n, kv, pf, at, _ in sel)
            rows.append({"tokens": f"{lo}" if lo == hi else f"{lo}-{hi if hi < 10**9 else ''}",
                         "kind": kind, "steps": len(sel),
                         "measured_ms": round(1e3 * meas / len(sel), 3),
                         "predicted_ms": round(1e3 * pred / len(sel), 3),
                         "rel_error": round(pred / meas - 1, 4) if meas > 0 else None,
                         "share_of_execute": round(meas / max(1e-12, sum(x[-1] for x in steps)),
                                                   4)})
    return rows


def _breakdown(real: dict, cost: CostModel) -> dict:
    steps = real["steps"]
    exec_s = sum(s[-1] for s in steps)
    fit_on_real = sum(cost.runner_time(t, n, kv, pf, at) for t, n, kv, pf, at, _ in steps)
    over_on_real = sum(cost.overhead_s + cost.overhead_seq_s * n for _, n, *_ in steps)
    return {
        "real_execute_s": round(exec_s, 3),
        "real_outside_execute_s": round(real["wall_s"] - exec_s, 3),
        "cost_model_on_real_steps_s": round(fit_on_real, 3),
        "fit_error_on_real_steps": round((fit_on_real - exec_s) / exec_s, 4) if exec_s else None,
        "overhead_per_step_ms": round(1e3 * (real["wall_s"] - exec_s) / max(1, len(steps)), 3),
        "fit_overhead_on_real_steps_s": round(over_on_real, 3),
        "real_attn_pairs": int(sum(s[4] for s in steps)),
        "residuals_by_tokens": step_residuals(steps, cost),
    }


def also(real: dict, others: dict[str, CostModel], predict) -> dict:
    """The same real run against other fits (lab side only): a same-run A/B of fits."""
    out = {}
    for name, other in others.items():
        t = predict(other)
        out[name] = {"predicted_s": round(t, 3),
                     "rel_error": round((t - real["wall_s"]) / real["wall_s"], 4),
                     "breakdown": _breakdown(real, other)}
    return out


def compare(engine, w: Workload, cost: CostModel, others: dict[str, CostModel] | None = None
            ) -> dict:
    prompt_lens = [len(engine.tokenize_prompt(r.prompt)) for r in w.requests]
    load_before = machine_info()["loadavg"]
    real = run_engine(engine, w)
    load_after = machine_info()["loadavg"]
    lab = run_lab_seconds(w, prompt_lens, lab_settings(engine), cost)
    res: SimResult = lab["result"]
    steps = real["steps"]
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
        "breakdown": _breakdown(real, cost),
        "load_average_before": load_before, "load_average_after": load_after,
        "other_cost_models": also(real, others or {}, lambda c: run_lab_seconds(
            w, prompt_lens, lab_settings(engine), c)["time_s"]),
    }


# --- the trade-off presets --------------------------------------------------------------------

METRICS = ("throughput_tokens_per_s", "p99_itl_s", "p99_ttft_s", "p99_latency_s",
           "p99_ttft_s_urgent")


def rate_scale(cost: CostModel) -> float:
    """How much faster `cost` runs the reference step than the shipped smollm2-cpu fit."""
    shipped = load_cost_model("smollm2-cpu")
    return shipped.step_time(*REFERENCE_STEP) / cost.step_time(*REFERENCE_STEP)


def preset_plan(preset: str, cost: CostModel, requests: int, scale: float):
    """The lab's plan of `preset` with `requests` requests, its arrival rate x `scale`."""
    from slo_workloads import plan, preset_options

    opts: dict[str, Any] = {"requests": requests, "cost_model": cost}
    rate = preset_options(preset).get("arrival_rate_s")
    if rate is not None:
        opts["arrival_rate_s"] = rate * scale
    return plan(preset, **opts)


def plan_engine_args(p, model: str | None):
    """EngineArgs with the plan's scheduler and KV-pool knobs (continuous batching)."""
    from iterserve.engine.args import EngineArgs

    st = p.settings["continuous"]
    sc, cc = st.scheduler, st.cache
    return EngineArgs(
        model=model, max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        enable_chunked_prefill=sc.enable_chunked_prefill,
        scheduling_policy=sc.scheduling_policy.value, preemption_mode=sc.preemption_mode.value,
        max_num_partial_prefills=sc.max_num_partial_prefills,
        long_prefill_token_threshold=sc.long_prefill_token_threshold,
        num_kv_blocks=cc.num_kv_blocks, block_size=cc.block_size,
        num_swap_blocks=cc.num_swap_blocks or None, max_model_len=sc.max_model_len)


def plan_workload(p, name: str, vocab: int, seed: int) -> tuple[Workload, dict[int, int]]:
    """The plan's requests as prompts of exactly prompt_len random token ids (any model's
    tokenizer counts them the same), and each request's priority class."""
    import random

    from iterserve.bench.workloads import BenchRequest

    rng = random.Random(f"{seed}:{name}:token-prompts")
    reqs = []
    for sp in sorted(p.specs, key=lambda x: x.index):
        ids = [rng.randrange(3, vocab) for _ in range(sp.prompt_len)]
        reqs.append(BenchRequest(index=sp.index, prompt=ids, prompt_len=sp.prompt_len,
                                 max_tokens=sp.output_len, arrival_s=float(sp.arrival_s or 0.0),
                                 kind="long" if sp.long else "short"))
    reqs.sort(key=lambda r: (r.arrival_s, r.index))
    w = Workload(name=name, seed=seed, rate=p.workload.arrival_rate_s, requests=tuple(reqs),
                 description=f"lab preset {name} ({len(reqs)} requests)")
    return w, {sp.index: sp.priority for sp in p.specs}


def real_metrics(w: Workload, times: dict, priorities: dict[int, int], wall: float) -> dict:
    """The lab's metrics, measured: the same percentile rule (numpy's linear)."""
    ttft, itl, lat, urgent = [], [], [], []
    tokens = 0
    classes = set(priorities.values())
    for i, (arrival, stamps) in times.items():
        if not stamps:
            continue
        tokens += len(stamps)
        ttft.append(stamps[0] - arrival)
        lat.append(stamps[-1] - arrival)
        itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
        if len(classes) > 1 and priorities.get(w.requests[i].index) == 0:
            urgent.append(stamps[0] - arrival)
    pct = lambda v: float(np.percentile(v, 99)) if v else None  # noqa: E731
    return {"throughput_tokens_per_s": tokens / wall if wall > 0 else None,
            "p99_itl_s": pct(itl), "p99_ttft_s": pct(ttft), "p99_latency_s": pct(lat),
            "p99_ttft_s_urgent": pct(urgent), "time_s": wall}


def _warm_up(engine) -> None:
    """One short request first (allocator, first-call paths), as for mix."""
    from iterserve.core.request import SamplingParams

    engine.add_request("lve-warm-up", list(range(3, 19)),
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def compare_preset(preset: str, cost: CostModel, args) -> dict:
    """One preset on a fresh engine with the plan's knobs vs the lab on the same plan."""
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.lab.api import simulate_plan
    from iterserve.lab.metrics import summarize

    scale = rate_scale(cost)
    n = args.preset_requests or PRESET_REQUESTS[preset]
    p = preset_plan(preset, cost, n, scale)
    engine = LLMEngine.from_engine_args(plan_engine_args(p, args.model))
    try:
        _warm_up(engine)
        w, prios = plan_workload(p, preset, engine.vocab_size, args.seed)
        policy = p.settings["continuous"].scheduler.scheduling_policy.value
        load_before = machine_info()["loadavg"]
        real = run_engine(engine, w, prios if policy == "priority" else None, stamps=True)
        load_after = machine_info()["loadavg"]
    finally:
        del engine
        gc.collect()
    sim = simulate_plan(p)["continuous"]
    lab = summarize(sim)
    got = real_metrics(w, real["token_times"], prios, real["wall_s"])
    lab_m = {k: lab.get(k) for k in METRICS}
    lab_m["time_s"] = lab["time_s"]
    err = {k: (lab_m[k] / got[k] - 1 if lab_m.get(k) and got.get(k) else None)
           for k in (*METRICS, "time_s")}
    return {"workload": {"name": preset, "requests": n, "rate_scale": round(scale, 4),
                         "arrival_rate_s": p.workload.arrival_rate_s,
                         "engine_args": {k: v for k, v in vars(plan_engine_args(p, None)).items()
                                         if k in ("max_num_seqs", "max_num_batched_tokens",
                                                  "enable_chunked_prefill", "scheduling_policy",
                                                  "preemption_mode", "num_kv_blocks",
                                                  "num_swap_blocks", "max_model_len")}},
            "real_wall_s": round(real["wall_s"], 3), "predicted_s": round(lab["time_s"], 3),
            "rel_error": round(err["time_s"], 4) if err["time_s"] is not None else None,
            "within_10pct": err["time_s"] is not None and abs(err["time_s"]) <= 0.10,
            "real_steps": len(real["steps"]), "lab_steps": lab["steps"],
            "real_busy_slot_steps": sum(st[1] for st in real["steps"]),
            "lab_busy_slot_steps": sim.busy_slot_steps,
            "real": got, "lab": lab_m,
            "lab_error": {k: (round(v, 4) if v is not None else None) for k, v in err.items()},
            "breakdown": _breakdown(real, cost),
            "load_average_before": load_before, "load_average_after": load_after}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    ap.add_argument("--cost-model", default="smollm2-cpu",
                    help="cost model file or shipped name (default smollm2-cpu): the fit of "
                         "--model on this machine (`iterserve lab calibrate --model ...`)")
    ap.add_argument("--workloads", default="mix,poisson",
                    help="comma list of mix, poisson and the presets " + ", ".join(PRESETS))
    ap.add_argument("--rate", type=float, default=0.5, help="poisson arrivals, requests/s")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--preset-requests", type=int, default=None,
                    help="requests per preset (default: " + ", ".join(
                        f"{k} {v}" for k, v in PRESET_REQUESTS.items()) + ")")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON report here too")
    ap.add_argument("--also-cost-models", default="",
                    help="comma list of more fits to predict the same real runs with (mix, "
                         "poisson: lab side only, a same-run A/B of fits)")
    args = ap.parse_args(argv)
    names = [x.strip() for x in args.workloads.split(",") if x.strip()]
    bad = [n for n in names if n not in ("mix", "poisson", *PRESETS)]
    if bad:
        ap.error(f"--workloads: unknown {', '.join(bad)}")

    from iterserve.engine.args import EngineArgs
    from iterserve.engine.llm import LLM
    from iterserve.engine.llm_engine import LLMEngine

    cost = load_cost_model(args.cost_model)
    others = {n: load_cost_model(n) for n in args.also_cost_models.split(",") if n.strip()}
    t_start = time.time()
    rows = []
    engine = None
    for name in names:
        if name in PRESETS:
            engine = None                   # one model in memory at a time
            gc.collect()
            row = compare_preset(name, cost, args)
        else:
            if engine is None:
                engine = LLMEngine.from_engine_args(EngineArgs(model=args.model,
                                                               max_num_seqs=MAX_NUM_SEQS))
                warm = build_workload("mix", seed=args.seed, num_requests=1)
                LLM.from_engine(engine).generate([warm.requests[0].prompt], _params(warm),
                                                 use_tqdm=False)
            rate = args.rate if name == "poisson" else None
            w = build_workload(name, seed=args.seed, rate=rate, num_requests=args.num_requests)
            row = compare(engine, w, cost, others)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "workload"}), file=sys.stderr,
              flush=True)
    report = {"kind": "lab_vs_engine", "model": args.model or "default",
              "cost_model": args.cost_model, "cost_model_description": cost.description,
              "cost_model_coefficients": cost.to_dict(),
              "max_num_seqs": MAX_NUM_SEQS, "engine_knobs": "EngineArgs defaults otherwise "
              "(mix, poisson); the preset's plan (presets)",
              "machine": machine_info(), "torch_threads": _threads(),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "wall_s": round(time.time() - t_start, 1), "results": rows}
    print(f"\n{'workload':15} {'real s':>8} {'lab s':>8} {'error':>7} {'steps':>6} "
          f"{'lab steps':>9} {'exec s':>7} {'fit on real':>11} {'overhead/step':>13}")
    for r in rows:
        b = r["breakdown"]
        fe = b["fit_error_on_real_steps"]
        print(f"{r['workload']['name']:15} {r['real_wall_s']:>8.2f} {r['predicted_s']:>8.2f} "
              f"{r['rel_error']:>+7.1%} {r['real_steps']:>6} {r['lab_steps']:>9} "
              f"{b['real_execute_s']:>7.2f} {(fe if fe is not None else 0):>+11.1%} "
              f"{b['overhead_per_step_ms']:>11.2f}ms")
    for r in rows:
        for name, o in r.get("other_cost_models", {}).items():
            print(f"  {r['workload']['name']} with {name}: lab {o['predicted_s']:.2f} s "
                  f"({o['rel_error']:+.1%}), fit on real steps "
                  f"{o['breakdown']['fit_error_on_real_steps']:+.1%}")
        print(f"  {r['workload']['name']} residuals by step tokens (measured / predicted ms): "
              + ", ".join(f"{x['tokens']} {x['kind']} x{x['steps']}: {x['measured_ms']:.1f}"
                          f"/{x['predicted_ms']:.1f}" for x in r["breakdown"][
                              "residuals_by_tokens"]))
    for r in rows:
        if "lab_error" in r:
            print(f"  {r['workload']['name']}: " + ", ".join(
                f"{k} real {r['real'][k]:.3f} lab {r['lab'][k]:.3f} "
                f"({r['lab_error'][k]:+.0%})" for k in METRICS
                if r["real"].get(k) is not None and r["lab"].get(k) is not None
                and r["lab_error"].get(k) is not None))
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _threads() -> int:
    import torch
    return torch.get_num_threads()


if __name__ == "__main__":
    sys.exit(main())
