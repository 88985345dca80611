"""Micro-benchmark: cost of one Scheduler.schedule() + update_from_output() step.

Not a test. Cases:
  decode-256   256 running requests, all decoding (1 token each per step)
  mixed-256    256 running, with new prompts of 64-512 tokens arriving so that chunked
               prefill (budget 2048), admission, finishing and (sometimes) preemption happen
  decode-8     8 running decodes: the lab's small-batch case (it runs ~1e6 such steps)
Each case also runs with prefix caching on. The fake executor samples token 1 for every
sampling chunk; nothing else is measured. Both wall time and process CPU time are reported:
on a shared machine the CPU figure is the stable one.

    .venv/bin/python benchmarks/bench_scheduler.py [--steps N] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.request import Request, SamplingParams
from iterserve.core.scheduler import Scheduler


def _step(s: Scheduler) -> None:
    out = s.schedule()
    get = s.requests.__getitem__        # the executor's "sample" rule, from the data
    s.update_from_output(out, {rid: 1 for rid, n in out.num_scheduled_tokens.items()
                               if (r := get(rid)).num_computed_tokens + n >= len(r.all_token_ids)})


def bench_decode(num_seqs: int, steps: int, caching: bool) -> dict:
    """All requests run for the whole measurement: a steady decode batch."""
    s = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs),
                                  max_model_len=1 << 20),
                  CacheConfig(block_size=16, num_kv_blocks=num_seqs * (steps // 16 + 8),
                              enable_prefix_caching=caching))
    for i in range(num_seqs):
        s.add_request(Request(f"r{i}", [1 + i % 7] * 16,
                              SamplingParams(max_tokens=steps + 100, ignore_eos=True)))
    while not all(r.num_output_tokens for r in s.running) or s.num_waiting:
        _step(s)                                        # prefill, not measured
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        _step(s)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"steps": steps, "us_per_step": dt / steps * 1e6,
            "cpu_us_per_step": cpu / steps * 1e6,
            "cpu_us_per_request_step": cpu / steps / num_seqs * 1e6}


def bench_mixed(num_seqs: int, steps: int, caching: bool, seed: int = 0) -> dict:
    """Requests of random prompt/output length keep the batch full; new ones prefill in chunks."""
    rng = random.Random(seed)
    s = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=2048,
                                  max_model_len=4096, long_prefill_token_threshold=512,
                                  max_num_partial_prefills=4),
                  CacheConfig(block_size=16, num_kv_blocks=num_seqs * 40,
                              enable_prefix_caching=caching))
    n = 0
    system = [3] * 48                                   # a shared "system prompt" prefix

    def top_up() -> None:
        nonlocal n
        while s.num_running + s.num_waiting < num_seqs + 8:
            prompt = system + [rng.randrange(1000) for _ in range(rng.randint(16, 464))]
            s.add_request(Request(f"m{n}", prompt, SamplingParams(
                max_tokens=rng.randint(16, 256), ignore_eos=True)))
            n += 1

    top_up()
    for _ in range(200):                                # warm up to a steady mix
        _step(s)
        top_up()
    tokens = preemptions = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        _step(s)
        top_up()
        st = s.stats()
        tokens += st.num_batched_tokens
        preemptions += st.num_preemptions
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"steps": steps, "us_per_step": dt / steps * 1e6,
            "cpu_us_per_step": cpu / steps * 1e6,
            "tokens_per_step": tokens / steps, "preemptions": preemptions,
            "requests_added": n, "note": "includes add_request and stats() per step"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--out", default="benchmarks/results/bench_scheduler.json")
    args = ap.parse_args()
    results = {"python": platform.python_version(), "machine": platform.machine(), "cases": {}}
    for caching in (False, True):
        tag = "+prefix-cache" if caching else ""
        for name, fn in ((f"decode-256{tag}", lambda: bench_decode(256, args.steps, caching)),
                         (f"decode-8{tag}", lambda: bench_decode(8, args.steps * 10, caching)),
                         (f"mixed-256{tag}", lambda: bench_mixed(256, args.steps, caching))):
            r = fn()
            results["cases"][name] = r
            extra = "".join(f"  {k}={v:.1f}" if isinstance(v, float) else f"  {k}={v}"
                            for k, v in r.items() if k not in ("us_per_step", "steps", "note"))
            print(f"{name:28s} {r['us_per_step']:9.1f} us/step{extra}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
