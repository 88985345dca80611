"""`iterserve bench offline`: the offline API on a real model, continuous vs static batching.

The real-model counterpart of the lab's reference case: the same `mix` workload, the same
engine, only `batching` differs, and the report uses the lab's definitions so the two can be
read side by side:
- steps: engine steps that ran a forward pass;
- slot utilisation: busy slot-steps / (steps x max_num_seqs), a busy slot-step being one
  request computed in one step (one scheduled chunk);
- mean latency: submit -> finished, seconds (all requests are submitted at t=0);
- output tok/s: generated tokens / wall time of the run (model load and warm-up excluded).

Why wrap the executor: the engine's per-step stats do not carry the number of scheduled
chunks; counting them at the executor boundary (the core<->executor contract) is exact and
needs no engine change.
"""

from __future__ import annotations

import time
from typing import Any


from .client import machine_info
from .workloads import Workload, build_workload

from iterserve.core.request import SamplingParams
from iterserve.engine.args import EngineArgs
from iterserve.engine.llm import LLM
from iterserve.engine.llm_engine import LLMEngine
from iterserve.errors import OfflineBenchError


class CountingExecutor:
    """Delegates to the real executor and counts steps, busy slots and forward time."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.steps = 0
        self.busy_slot_steps = 0
        self.forward_s = 0.0

    def execute(self, output):
        if output.num_scheduled_tokens:
            self.steps += 1
            self.busy_slot_steps += len(output.num_scheduled_tokens)
        t = time.perf_counter()
        try:
            return self.inner.execute(output)
        finally:
            self.forward_s += time.perf_counter() - t

    def __getattr__(self, name: str) -> Any:    # everything else: the real runner
        return getattr(self.inner, name)


def _sampling_params(w: Workload):
    return [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            for r in w.requests]


def run_mode(w: Workload, batching: str, max_num_seqs: int, model: str | None,
             **engine_args: Any) -> dict:
    """One offline run of `w` with the given batching mode; the dict goes into the report."""
    args = EngineArgs(model=model, max_num_seqs=max_num_seqs, batching=batching, **engine_args)
    engine = LLMEngine.from_engine_args(args)
    llm = LLM.from_engine(engine)
    # warm-up (allocator, first-call overheads) outside the timed region
    llm.generate([w.requests[0].prompt], _sampling_params(w)[:1], use_tqdm=False)
    counter = CountingExecutor(engine.executor)
    engine.executor = counter
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in w.requests], _sampling_params(w), use_tqdm=False)
    wall = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    if gen != w.total_output_tokens:
        raise RuntimeError(f"engine generated {gen} tokens, the workload asks for "
                           f"{w.total_output_tokens} (ignore_eos not honoured?)")
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)   # this model's tokenizer
    e2e = [o.metrics.e2e_latency for o in outs
           if o.metrics is not None and o.metrics.e2e_latency is not None]
    ttft = [o.metrics.time_to_first_token for o in outs
            if o.metrics is not None and o.metrics.time_to_first_token is not None]
    return {
        "engine": "iterserve", "batching": batching, "max_num_seqs": max_num_seqs,
        "wall_s": round(wall, 3), "steps": counter.steps,
        "forward_s": round(counter.forward_s, 3),
        "slot_utilisation": round(counter.busy_slot_steps / (counter.steps * max_num_seqs), 4)
        if counter.steps else 0.0,
        "output_tokens": gen,
        "output_throughput": round(gen / wall, 3),
        "prompt_tokens": prompt_tokens,
        "total_token_throughput": round((gen + prompt_tokens) / wall, 3),
        "mean_latency_s": round(sum(e2e) / len(e2e), 3) if e2e else None,
        "mean_ttft_s": round(sum(ttft) / len(ttft), 3) if ttft else None,
    }


def run_offline(model: str | None = None, workload: str = "mix",
                modes: list[str] | tuple[str, ...] = ("continuous", "static"),
                max_num_seqs: int = 8, seed: int = 0, num_requests: int | None = None,
                **engine_args: Any) -> dict:
    """Run each batching mode on the workload; return the JSON-ready report."""
    bad = [m for m in modes if m not in ("continuous", "static")]
    if bad or not modes:
        raise OfflineBenchError(f"batching modes must be 'continuous' and/or 'static', got {modes}")
    if max_num_seqs < 1:
        raise OfflineBenchError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    w = build_workload(workload, seed=seed, num_requests=num_requests)
    if any(r.arrival_s for r in w.requests):
        raise OfflineBenchError(f"workload {workload!r} has arrival times; the offline API "
                                "submits everything at t=0 (use `bench serve` for it)")
    runs = [run_mode(w, m, max_num_seqs, model, **engine_args) for m in modes]
    return {"kind": "offline", "model": model or "default", "machine": machine_info(),
            "workload": w.summary(), "runs": runs}
