"""Turn a simulated run into the report shared by the CLI, `POST /v1/lab/run` and the /lab page.

Definitions (all latencies in steps; keys ending in `_s` are simulated seconds from the
cost model):
- utilization = busy slot-steps / (steps x slots), a busy slot-step being one request
  computed in one step;
- latency = finish - arrival; ttft = first token - arrival (a token of step s counts at the
  end of the step, s + 1); in seconds, with seconds arrivals (a rate in seconds, the presets)
  the arrival is the request's own arrival time, so the wait for the step in flight when it
  arrived counts (the engine adds a request between two steps); itl = the gaps between consecutive tokens of a request, over all
  requests' tokens;
- percentiles interpolate linearly between order statistics (numpy's default);
- requests refused at arrival (slo policy, a full queue under max_queued_requests) are
  counted (`refused`, `refused_queue_full`) and left out of every other statistic; requests
  that ended by timeout (request_timeout / queue_timeout) are counted in `timed_out`, their
  tokens count in `tokens` and the ITL, and latency / TTFT are over the completed requests.
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
    arrival = (res.arrival_step if res.arrival_step is not None else
               np.fromiter((s.arrival for s in specs), dtype=np.int64, count=len(specs)))
    output_len = np.fromiter((s.output_len for s in specs), dtype=np.int64, count=len(specs))
    S = res.step_start_s
    slo = _slo_block(res, arrival, output_len)      # before refused requests are dropped
    num_requests = len(specs)
    counts: dict[str, int] = {}
    if res.queue_full is not None:
        counts["refused_queue_full"] = int(res.queue_full.sum())
    if res.refused is not None and res.refused.any():
        served = ~res.refused
        res = _served_only(res, served)
        specs = res.specs
        arrival, output_len = arrival[served], output_len[served]
    # Seconds from the arrival itself, not from the step it was first seen in: a request
    # arriving mid-step waits for the step in flight to end (as on the real engine, whose
    # loop adds it between steps), and that wait is part of its TTFT and latency.
    arrival_s = _arrival_seconds(specs, S, arrival)
    if res.timed_out is not None:
        counts["timed_out"] = int(res.timed_out.sum())
        tokens = int(res.output_tokens.sum())
        done = ~res.timed_out                       # latency / TTFT: completed requests
        finish, first_token, arrival = res.finish[done], res.first_token[done], arrival[done]
        arrival_s = arrival_s[done]
    else:
        tokens = int(output_len.sum())
        finish, first_token = res.finish, res.first_token
    latency = finish - arrival
    slots = res.settings.slots
    time_s = float(S[-1])
    out: dict[str, Any] = {
        "steps": res.steps,
        "utilization": res.busy_slot_steps / (res.steps * slots) if res.steps else 0.0,
        "mean_latency": _mean(latency),
        "p50_latency": _pct(latency, 50),
        "p99_latency": _pct(latency, 99),
        "requests": num_requests,                   # refused ones included
        "tokens": tokens,
        "slots": slots,
        "time_s": time_s,
        "throughput_tokens_per_s": tokens / time_s if time_s > 0 else 0.0,
    }
    latency_s = S[finish] - arrival_s
    out["mean_latency_s"] = _mean(latency_s)
    out["p99_latency_s"] = _pct(latency_s, 99)

    if not res.settings.prefill_ignored:
        ttft = first_token - arrival
        ttft_s = S[first_token] - arrival_s
        out.update(mean_ttft=_mean(ttft), p50_ttft=_pct(ttft, 50), p99_ttft=_pct(ttft, 99),
                   mean_ttft_s=_mean(ttft_s), p99_ttft_s=_pct(ttft_s, 99))
        prio = np.fromiter((s.priority for s in specs), dtype=np.int64, count=len(specs))
        if res.timed_out is not None:
            prio = prio[done]
        urgent = prio == 0
        if urgent.any() and not urgent.all():      # two classes: the urgent one's TTFT
            out.update(urgent_requests=int(urgent.sum()),
                       mean_ttft_s_urgent=_mean(ttft_s[urgent]),
                       p99_ttft_s_urgent=_pct(ttft_s[urgent], 99),
                       p99_ttft_s_normal=_pct(ttft_s[~urgent], 99))
        if res.itl_prev is not None:
            itl = res.itl_next - res.itl_prev
            itl_s = S[res.itl_next] - S[res.itl_prev]
            out.update(mean_itl=_mean(itl), p99_itl=_pct(itl, 99),
                       mean_itl_s=_mean(itl_s), p99_itl_s=_pct(itl_s, 99),
                       max_itl_s=float(itl_s.max()) if itl_s.size else 0.0)
        out["preemptions"] = int(res.preemptions.sum())
        out["prompt_tokens"] = int(sum(s.prompt_len for s in specs))
        out["computed_tokens"] = res.computed_tokens

    out.update(counts)
    if res.spec_decoding is not None:
        out["spec_decoding"] = res.spec_decoding
    if slo:
        out.update(slo)
    if per_request:
        out["per_request"] = per_request_records(res)
        if res.timeline is not None:
            out["timeline"] = res.timeline
    return out


def _arrival_seconds(specs, S: np.ndarray, arrival: np.ndarray) -> np.ndarray:
    """Each request's arrival in simulated seconds: its own `arrival_s` when the workload
    has seconds arrivals (capped at the start of the step it was added in), else the start
    of its arrival step."""
    at_step = S[arrival]
    if not specs or specs[0].arrival_s is None:
        return at_step
    own = np.fromiter((s.arrival_s for s in specs), dtype=np.float64, count=len(specs))
    return np.minimum(own, at_step)


def _served_only(res: SimResult, served: np.ndarray) -> SimResult:
    """The run without the requests add_request refused (latency stats are over served)."""
    from dataclasses import replace

    idx = np.flatnonzero(served)
    return replace(res, specs=[res.specs[i] for i in idx], finish=res.finish[served],
                   first_token=res.first_token[served],
                   first_scheduled=res.first_scheduled[served],
                   preemptions=res.preemptions[served],
                   segments=None if res.segments is None else [res.segments[i] for i in idx],
                   events=None if res.events is None else [res.events[i] for i in idx],
                   arrival_step=None if res.arrival_step is None else res.arrival_step[served],
                   refused=None, queue_full=None,
                   timed_out=None if res.timed_out is None else res.timed_out[served],
                   output_tokens=(None if res.output_tokens is None
                                  else res.output_tokens[served]))


def _slo_block(res: SimResult, arrival_step: np.ndarray,
               output_len: np.ndarray) -> dict[str, Any]:
    """Goodput: requests per simulated second that met both targets (a refused request
    meets neither). ttft = first token - arrival (seconds arrivals when the workload has
    them); tpot = (finish - first token) / (output tokens - 1), vLLM's definition."""
    st = res.settings.scheduler
    if st.slo_ttft_ms is None and st.slo_tpot_ms is None:
        return {}
    S = res.step_start_s
    if res.specs and res.specs[0].arrival_s is not None:
        arrival_s = np.fromiter((s.arrival_s for s in res.specs), dtype=np.float64,
                                count=len(res.specs))
    else:
        arrival_s = S[arrival_step]
    refused = res.refused if res.refused is not None else np.zeros(len(res.specs), bool)
    ttft_s = S[res.first_token] - arrival_s
    tpot_s = (S[res.finish] - S[res.first_token]) / np.maximum(output_len - 1, 1)
    ok = ~refused
    if res.timed_out is not None:
        ok &= ~res.timed_out                      # a timed-out request meets no target
    if st.slo_ttft_ms is not None:
        ok &= ttft_s <= st.slo_ttft_ms / 1000.0
    if st.slo_tpot_ms is not None:
        ok &= tpot_s <= st.slo_tpot_ms / 1000.0
    time_s = float(S[-1])
    good = int(ok.sum())
    return {"slo_ttft_ms": st.slo_ttft_ms, "slo_tpot_ms": st.slo_tpot_ms,
            "refused": int(refused.sum()), "slo_met": good,
            "slo_attainment": good / len(res.specs) if len(res.specs) else 0.0,
            "goodput_rps": good / time_s if time_s > 0 else 0.0}


def per_request_records(res: SimResult) -> list[dict[str, Any]]:
    if res.segments is None or res.events is None:
        raise ValueError("per-request records need a run made with record=True")
    S = res.step_start_s
    last = len(S) - 1
    records = []
    for i, spec in enumerate(res.specs):
        arrival = spec.arrival if res.arrival_step is None else int(res.arrival_step[i])
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
            "arrival": arrival,
            "first_scheduled": int(res.first_scheduled[i]),
            "first_token": ft,
            "finish": fin,
            "prompt_len": spec.prompt_len,
            "output_len": spec.output_len,
            "long": spec.long,
            "priority": spec.priority,
            "latency": fin - arrival,
            "ttft": ft - arrival,
            "latency_s": float(S[fin] - S[arrival]),
            "preemptions": int(res.preemptions[i]),
            "segments": res.segments[i],
            "events": events,
        })
        if res.timed_out is not None:
            records[-1].update(finish_reason="timeout" if res.timed_out[i] else "length",
                               output_tokens=int(res.output_tokens[i]))
    return records
