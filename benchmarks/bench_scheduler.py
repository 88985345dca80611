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

`--baseline SRC` compares this tree's scheduler with another tree's (SRC: its `src`
directory, e.g. of a `git worktree` at an older commit). Both are imported into this one
process, each case is set up identically for both, and their steps are timed in alternating
chunks (`--rounds` per arm, the order flipped every round), so machine load falls on both
arms alike. Reported per case: CPU us/step of each arm, their ratio (this / baseline, from
the totals) and the median of the per-round ratios.

    .venv/bin/python benchmarks/bench_scheduler.py --baseline /path/to/old/src [--rounds 20]
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

_MODULES = {"Scheduler": "iterserve.core.scheduler", "SchedulerConfig": "iterserve.core.config",
            "CacheConfig": "iterserve.core.config", "Request": "iterserve.core.request",
            "SamplingParams": "iterserve.core.request"}


def _names() -> SimpleNamespace:
    return SimpleNamespace(**{k: getattr(importlib.import_module(v), k)
                              for k, v in _MODULES.items()})


def load_tree(src: Path) -> SimpleNamespace:
    """The scheduler classes of the iterserve under `src`, imported next to this process's.

    Its modules are imported under their own names and then moved out of sys.modules, so
    each class keeps its own tree's globals. The cases use the fcfs policy, whose path
    imports nothing at run time (a function-local import would find this process's tree)."""
    mine = {k: sys.modules.pop(k) for k in list(sys.modules)
            if k == "iterserve" or k.startswith("iterserve.")}
    sys.path.insert(0, str(src))
    try:
        tree = _names()
        assert Path(sys.modules["iterserve"].__file__).resolve().is_relative_to(src.resolve())
    finally:
        sys.path.remove(str(src))
        for k in [k for k in sys.modules if k == "iterserve" or k.startswith("iterserve.")]:
            del sys.modules[k]
        sys.modules.update(mine)
    return tree


def _step(s) -> None:
    out = s.schedule()
    get = s.requests.__getitem__        # the executor's "sample" rule, from the data
    s.update_from_output(out, {rid: 1 for rid, n in out.num_scheduled_tokens.items()
                               if (r := get(rid)).num_computed_tokens + n >= len(r.all_token_ids)})


def decode_case(m: SimpleNamespace, num_seqs: int, steps: int, caching: bool) -> Callable:
    """All requests run for the whole measurement: a steady decode batch. Returns the
    measured step (after the prefills, which are not measured)."""
    s = m.Scheduler(m.SchedulerConfig(max_num_seqs=num_seqs,
                                      max_num_batched_tokens=max(2048, num_seqs),
                                      max_model_len=1 << 20),
                    m.CacheConfig(block_size=16, num_kv_blocks=num_seqs * (steps // 16 + 8),
                                  enable_prefix_caching=caching))
    for i in range(num_seqs):
        s.add_request(m.Request(f"r{i}", [1 + i % 7] * 16,
                                m.SamplingParams(max_tokens=steps + 100, ignore_eos=True)))
    while not all(r.num_output_tokens for r in s.running) or s.num_waiting:
        _step(s)

    def step() -> None:
        _step(s)
    step.num_seqs = num_seqs
    return step


def mixed_case(m: SimpleNamespace, num_seqs: int, caching: bool, seed: int = 0) -> Callable:
    """Requests of random prompt/output length keep the batch full; new ones prefill in
    chunks. The measured step includes add_request and stats(); it returns the step's
    (batched tokens, preemptions)."""
    rng = random.Random(seed)
    s = m.Scheduler(m.SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=2048,
                                      max_model_len=4096, long_prefill_token_threshold=512,
                                      max_num_partial_prefills=4),
                    m.CacheConfig(block_size=16, num_kv_blocks=num_seqs * 40,
                                  enable_prefix_caching=caching))
    n = 0
    system = [3] * 48                                   # a shared "system prompt" prefix

    def top_up() -> None:
        nonlocal n
        while s.num_running + s.num_waiting < num_seqs + 8:
            prompt = system + [rng.randrange(1000) for _ in range(rng.randint(16, 464))]
            s.add_request(m.Request(f"m{n}", prompt, m.SamplingParams(
                max_tokens=rng.randint(16, 256), ignore_eos=True)))
            n += 1

    def step() -> tuple[int, int]:
        _step(s)
        top_up()
        st = s.stats()
        return st.num_batched_tokens, st.num_preemptions

    top_up()
    for _ in range(200):                                # warm up to a steady mix
        step()
    step.requests_added = lambda: n
    return step


def cases(m: SimpleNamespace, steps: int) -> dict[str, tuple[Callable[[], Callable], int]]:
    """Case name -> (a function setting it up, the steps to measure)."""
    out = {}
    for caching in (False, True):
        tag = "+prefix-cache" if caching else ""
        out[f"decode-256{tag}"] = (lambda c=caching: decode_case(m, 256, steps, c), steps)
        out[f"decode-8{tag}"] = (lambda c=caching: decode_case(m, 8, steps * 10, c), steps * 10)
        out[f"mixed-256{tag}"] = (lambda c=caching: mixed_case(m, 256, c), steps)
    return out


def run_case(setup: Callable[[], Callable], steps: int) -> dict:
    step = setup()
    tokens = preemptions = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        r = step()
        if r is not None:
            tokens += r[0]
            preemptions += r[1]
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    res = {"steps": steps, "us_per_step": dt / steps * 1e6, "cpu_us_per_step": cpu / steps * 1e6}
    if hasattr(step, "requests_added"):
        res.update(tokens_per_step=tokens / steps, preemptions=preemptions,
                   requests_added=step.requests_added(),
                   note="includes add_request and stats() per step")
    else:
        res["cpu_us_per_request_step"] = res["cpu_us_per_step"] / step.num_seqs
    return res


def ab(baseline: Path, steps: int, rounds: int, only: list[str] | None) -> dict:
    """This tree against `baseline`, each case's steps timed in alternating chunks."""
    arms = {"this": _names(), "baseline": load_tree(baseline)}
    report = {"baseline": str(baseline), "rounds": rounds, "steps": steps, "cases": {}}
    this_cases = cases(arms["this"], steps)
    base_cases = cases(arms["baseline"], steps)
    for name in only or list(this_cases):
        total = this_cases[name][1]
        chunk = max(1, total // rounds)
        stepper = {"this": this_cases[name][0](), "baseline": base_cases[name][0]()}
        cpu: dict[str, list[float]] = {"this": [], "baseline": []}
        for k in range(rounds):
            for arm in (("this", "baseline") if k % 2 == 0 else ("baseline", "this")):
                step = stepper[arm]
                c0 = time.process_time()
                for _ in range(chunk):
                    step()
                cpu[arm].append((time.process_time() - c0) / chunk * 1e6)
        t, b = (sum(cpu[a]) / rounds for a in ("this", "baseline"))
        med = statistics.median(x / y for x, y in zip(cpu["this"], cpu["baseline"]))
        report["cases"][name] = {"cpu_us_per_step_this": t, "cpu_us_per_step_baseline": b,
                                 "ratio": t / b, "median_round_ratio": med}
        print(f"{name:28s} this {t:9.1f}  baseline {b:9.1f} cpu us/step  "
              f"ratio {t / b:.3f}  (median of rounds {med:.3f})")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--out", default="benchmarks/results/bench_scheduler.json")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another tree's src directory: A/B this scheduler against it")
    ap.add_argument("--rounds", type=int, default=20, help="A/B chunks per arm")
    ap.add_argument("--case", action="append", default=None,
                    help="run only this case (repeatable)")
    args = ap.parse_args()
    if args.baseline is not None:
        results = ab(args.baseline, args.steps, args.rounds, args.case)
    else:
        results = {"python": platform.python_version(), "machine": platform.machine(),
                   "cases": {}}
        for name, (setup, steps) in cases(_names(), args.steps).items():
            if args.case and name not in args.case:
                continue
            r = run_case(setup, steps)
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
