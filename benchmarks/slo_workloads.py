"""One definition for the lab and the real engine: a lab preset as requests and serve flags.

The scheduling experiments are lab presets (`iterserve.lab.options.PRESETS`); the real-engine
benchmarks (`slo_engine.py`, `slo_engine_tradeoffs.py`) run the *same* requests: the lab
plans the preset (`plan_lab`: the same seeded draw of prompt lengths, output lengths,
arrival times and classes), and this module turns the plan into what the bench client
sends (prompts of exactly that many tokens, `max_tokens` = the output length, ignore_eos)
and into the `iterserve serve` flags of the plan's scheduler and cache knobs. So "the lab's
error against the real engine" compares one workload on one set of knobs, not two
look-alikes.
"""

from __future__ import annotations

import random
from typing import Any

from iterserve.bench.workloads import BenchRequest, Workload, make_prompt
from iterserve.lab.api import LabPlan, plan_lab
from iterserve.lab.options import PRESETS, apply_preset


def preset_options(preset: str, **over: Any) -> dict[str, Any]:
    """The preset's options with `over` on top (a None in `over` removes the preset's)."""
    opts = {**PRESETS[preset]["options"], **over}
    return {k: v for k, v in opts.items() if v is not None}


def plan(preset: str, **over: Any) -> LabPlan:
    opts = apply_preset({"preset": None, **preset_options(preset, **over)})
    if isinstance(opts.get("cost_model"), str):
        from iterserve.core.cost_model import load_cost_model

        opts["cost_model"] = load_cost_model(opts["cost_model"])
    opts.setdefault("batching", "continuous")
    return plan_lab(opts)


def bench_workload(p: LabPlan, name: str, *, burst: bool = False) -> Workload:
    """The plan's requests for the bench client: arrival seconds from the plan's Poisson
    draw (`arrival_rate_s`), all at t=0 for a burst (or a plan without a rate)."""
    rng = random.Random(f"{p.workload.seed}:prompts-text")
    reqs = []
    for s in sorted(p.specs, key=lambda s: s.index):
        arrival = 0.0 if burst or s.arrival_s is None else float(s.arrival_s)
        kind = "long" if s.long else "short"
        reqs.append(BenchRequest(index=s.index, prompt=make_prompt(s.prompt_len, rng),
                                 prompt_len=s.prompt_len, max_tokens=s.output_len,
                                 arrival_s=arrival, kind=kind))
    reqs.sort(key=lambda r: (r.arrival_s, r.index))
    rate = None if burst else p.workload.arrival_rate_s
    return Workload(name=name, seed=p.workload.seed, rate=rate, requests=tuple(reqs),
                    description=f"lab preset {name} ({len(reqs)} requests)",
                    extra={"priorities": {s.index: s.priority for s in p.specs}})


def serve_args(p: LabPlan) -> list[str]:
    """`iterserve serve` flags for the plan's scheduler and cache knobs (continuous mode)."""
    st = p.settings["continuous"]
    sc, cc = st.scheduler, st.cache
    args = ["--max-num-seqs", str(sc.max_num_seqs),
            "--max-num-batched-tokens", str(sc.max_num_batched_tokens),
            "--enable-chunked-prefill" if sc.enable_chunked_prefill
            else "--no-enable-chunked-prefill",
            "--scheduling-policy", sc.scheduling_policy.value,
            "--preemption-mode", sc.preemption_mode.value,
            "--max-num-partial-prefills", str(sc.max_num_partial_prefills),
            "--num-kv-blocks", str(cc.num_kv_blocks), "--block-size", str(cc.block_size)]
    if sc.long_prefill_token_threshold:
        args += ["--long-prefill-token-threshold", str(sc.long_prefill_token_threshold)]
    if sc.max_long_partial_prefills is not None:
        args += ["--max-long-partial-prefills", str(sc.max_long_partial_prefills)]
    if sc.max_long_prefill_tokens:
        args += ["--max-long-prefill-tokens", str(sc.max_long_prefill_tokens)]
    if sc.priority_less_urgent_tokens:
        args += ["--priority-less-urgent-tokens", str(sc.priority_less_urgent_tokens),
                 "--priority-guard-steps", str(sc.priority_guard_steps)]
    if cc.num_swap_blocks:
        args += ["--num-swap-blocks", str(cc.num_swap_blocks)]
    # The lab's max_model_len is what the workload needs (the longest prompt + output); the
    # budget without chunked prefill covers it, as the engine's rule requires.
    args += ["--max-model-len", str(sc.max_model_len)]
    return args
