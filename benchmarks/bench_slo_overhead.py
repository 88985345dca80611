"""Micro-benchmark: what the `slo` policy adds to one scheduler step below capacity.

Same cases and fake executor as benchmarks/bench_scheduler.py, each run with policy fcfs
and policy slo (targets set: TTFT 1 s, TPOT 100 ms, so every hook runs) in the same process,
alternating, several rounds; process CPU time per step, median over rounds. Below capacity
means no request waits, which is where the policy should cost nothing measurable:
  decode-256   256 running decodes
  decode-8     8 running decodes
  churn-64     up to 56 of 64 slots busy, prompts of 16-464 tokens arriving and finishing
               (admission, chunked prefill, finishing every few steps; the queue drains)
Under a shared machine's load only the same-process A/B difference means anything.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_slo_overhead.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.request import Request, SamplingParams
from iterserve.core.scheduler import Scheduler

SLO = {"slo_ttft_ms": 1000.0, "slo_tpot_ms": 100.0}


def _step(s: Scheduler) -> None:
    out = s.schedule()
    reqs = s.requests
    s.update_from_output(out, {rid: 1 for rid, n in out.num_scheduled_tokens.items()
                               if reqs[rid].num_computed_tokens + n >= reqs[rid].num_tokens})


def _config(policy: str, **kw) -> SchedulerConfig:
    return SchedulerConfig(scheduling_policy=policy, **(SLO if policy == "slo" else {}), **kw)


def decode(policy: str, num_seqs: int, steps: int) -> float:
    s = Scheduler(_config(policy, max_num_seqs=num_seqs,
                          max_num_batched_tokens=max(2048, num_seqs), max_model_len=1 << 20),
                  CacheConfig(block_size=16, num_kv_blocks=num_seqs * (steps // 16 + 8)))
    for i in range(num_seqs):
        s.add_request(Request(f"r{i}", [1 + i % 7] * 16,
                              SamplingParams(max_tokens=steps + 100, ignore_eos=True),
                              arrival_time=s.clock()))
    while not all(r.num_output_tokens for r in s.running) or s.num_waiting:
        _step(s)
    c0 = time.process_time()
    for _ in range(steps):
        _step(s)
    return (time.process_time() - c0) / steps * 1e6


def churn(policy: str, steps: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    s = Scheduler(_config(policy, max_num_seqs=64, max_num_batched_tokens=2048,
                          max_model_len=4096, long_prefill_token_threshold=512,
                          max_num_partial_prefills=4),
                  CacheConfig(block_size=16, num_kv_blocks=64 * 40))
    n = 0

    def top_up() -> None:
        nonlocal n
        while s.num_running + s.num_waiting < 56:
            s.add_request(Request(f"m{n}", [rng.randrange(1000) for _ in range(rng.randint(16, 464))],
                                  SamplingParams(max_tokens=rng.randint(16, 256), ignore_eos=True),
                                  arrival_time=s.clock()))     # on the scheduler's clock
            n += 1

    top_up()
    for _ in range(200):
        _step(s)
        top_up()
    c0 = time.process_time()
    for _ in range(steps):
        _step(s)
        top_up()
    assert s.slo is None or s.slo.num_refused == 0
    return (time.process_time() - c0) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/bench_slo_overhead.json")
    args = ap.parse_args()
    cases = {
        "decode-256": lambda p: decode(p, 256, args.steps),
        "decode-8": lambda p: decode(p, 8, args.steps * 5),
        "churn-64": lambda p: churn(p, args.steps),
    }
    results = {"python": platform.python_version(), "machine": platform.machine(),
               "rounds": args.rounds, "note": "process CPU us per step, median of rounds, "
               "fcfs and slo alternating in one process", "cases": {}}
    for name, fn in cases.items():
        times: dict[str, list[float]] = {"fcfs": [], "slo": []}
        for _ in range(args.rounds):
            for policy in ("fcfs", "slo"):
                times[policy].append(fn(policy))
        f, o = statistics.median(times["fcfs"]), statistics.median(times["slo"])
        results["cases"][name] = {"fcfs_cpu_us_per_step": f, "slo_cpu_us_per_step": o,
                                  "overhead_us_per_step": o - f,
                                  "overhead_pct": (o - f) / f * 100, "raw": times}
        print(f"{name:12s} fcfs {f:8.1f} us/step   slo {o:8.1f} us/step   "
              f"+{o - f:6.1f} us ({(o - f) / f:+.1%})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
