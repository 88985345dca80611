"""Turn a simulated run into the report shared by the CLI, `POST /v1/lab/run` and the /lab page.

Definitions (all latencies in steps; keys ending in `_s` are simulated seconds from the
cost model):
- utilization = busy slot-steps / (steps x slots), a busy slot-step being one request
  computed in one step;
- latency = finish - arrival; ttft = first token - arrival (a token of step s counts at the
  end of the step, s + 1); itl = the gaps between consecutive tokens of a request, over all
  requests' tokens;
- percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from iterserve.lab.simulator import SimResult


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else 0.0


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else 0.0


def summarize(res: SimResult, *, per_request: bool = False) -> dict[str, Any]:
    """The ModeResult dict of one run."""
    specs = res.specs
    arrival = np.fromiter((s.arrival for s in specs), dtype=np.int64, count=len(specs))
    output_len = np.fromiter((s.output_len for s in specs), dtype=np.int64, count=len(specs))
    S = res.step_start_s
    latency = res.finish - arrival
    tokens = int(output_len.sum())
    slots = res.settings.slots
    time_s = float(S[-1])
    out: dict[str, Any] = {
        "steps": res.steps,
        "utilization": res.busy_slot_steps / (res.steps * slots) if res.steps else 0.0,
        "mean_latency": _mean(latency),
        "p50_latency": _pct(latency, 50),
        "p99_latency": _pct(latency, 99),
        "requests": len(specs),
        "tokens": tokens,
        "slots": slots,
        "time_s": time_s,
        "throughput_tokens_per_s": tokens / time_s if time_s > 0 else 0.0,
    }
    latency_s = S[res.finish] - S[arrival]
    out["mean_latency_s"] = _mean(latency_s)
    out["p99_latency_s"] = _pct(latency_s, 99)

    if not res.settings.prefill_ignored:
        ttft = res.first_token - arrival
        ttft_s = S[res.first_token] - S[arrival]
        out.update(mean_ttft=_mean(ttft), p50_ttft=_pct(ttft, 50), p99_ttft=_pct(ttft, 99),
                   mean_ttft_s=_mean(ttft_s), p99_ttft_s=_pct(ttft_s, 99))
        if res.itl_prev is not None:
            itl = res.itl_next - res.itl_prev
            itl_s = S[res.itl_next] - S[res.itl_prev]
            out.update(mean_itl=_mean(itl), p99_itl=_pct(itl, 99),
                       mean_itl_s=_mean(itl_s), p99_itl_s=_pct(itl_s, 99))
        out["preemptions"] = int(res.preemptions.sum())
        out["prompt_tokens"] = int(sum(s.prompt_len for s in specs))
        out["computed_tokens"] = res.computed_tokens

    if per_request:
        out["per_request"] = per_request_records(res)
        if res.timeline is not None:
            out["timeline"] = res.timeline
    return out


def per_request_records(res: SimResult) -> list[dict[str, Any]]:
    if res.segments is None or res.events is None:
        raise ValueError("per-request records need a run made with record=True")
    S = res.step_start_s
    last = len(S) - 1
    records = []
    for i, spec in enumerate(res.specs):
        fin = int(res.finish[i])
        ft = int(res.first_token[i])
        events = []
        for e in res.events[i]:
            t = e.get("time")
            if isinstance(t, (int, float)):
                e = dict(e, time_s=float(S[min(max(int(t), 0), last)]))
            events.append(e)
        records.append({
            "id": f"req-{spec.index:06d}",
            "arrival": spec.arrival,
            "first_scheduled": int(res.first_scheduled[i]),
            "first_token": ft,
            "finish": fin,
            "prompt_len": spec.prompt_len,
            "output_len": spec.output_len,
            "long": spec.long,
            "priority": spec.priority,
            "latency": fin - spec.arrival,
            "ttft": ft - spec.arrival,
            "latency_s": float(S[fin] - S[spec.arrival]),
            "preemptions": int(res.preemptions[i]),
            "segments": res.segments[i],
            "events": events,
        })
    return records
