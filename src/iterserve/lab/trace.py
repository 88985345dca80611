"""A Chrome trace (chrome://tracing, ui.perfetto.dev) of lab runs: follow one request end to end.

Layout: one process per batching mode, one thread (track) per slot. Each request phase it
spends in a slot is a complete event ("X") named after the request, category "prefill" or
"decode". Each request also gets an async span ("b"/"e", category "request") from arrival to
finish, with nested "queued" / "preempted" spans while it waits, so selecting it shows its
whole life. Counter tracks ("C") show running, waiting and preempted requests and KV blocks
in use per step.

Timestamps are simulated microseconds from the cost model (so long steps look long); every
event's args carry the step numbers too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from iterserve.lab.simulator import SimResult

_PID = {"static": 1, "continuous": 2}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace(results: dict[str, SimResult]) -> dict[str, Any]:
    """The trace as a JSON-ready dict ({"traceEvents": [...], ...})."""
    events: list[dict[str, Any]] = []
    for mode, res in results.items():
        if res.segments is None or res.timeline is None:
            raise ValueError("a trace needs runs made with record=True")
        pid = _PID.get(mode, len(_PID) + 1)
        S = res.step_start_s
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"{mode} batching ({res.settings.slots} slots)"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for slot in range(res.settings.slots):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": slot + 1,
                           "args": {"name": f"slot {slot}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid,
                           "tid": slot + 1, "args": {"sort_index": slot + 1}})

        for i, spec in enumerate(res.specs):
            rid = f"req-{spec.index:06d}"
            segs = res.segments[i]
            for seg in segs:
                events.append({
                    "ph": "X", "name": rid, "cat": seg["kind"], "pid": pid,
                    "tid": seg["slot"] + 1, "ts": _us(S[seg["start"]]),
                    "dur": _us(S[seg["end"]] - S[seg["start"]]),
                    "args": {"request": rid, "start_step": seg["start"],
                             "end_step": seg["end"], "prompt_len": spec.prompt_len,
                             "output_len": spec.output_len, "long": spec.long},
                })
            if res.refused is not None and res.refused[i]:
                continue                    # refused at arrival (slo policy, full queue)
            arrival = spec.arrival if res.arrival_step is None else int(res.arrival_step[i])
            finish = int(res.finish[i])
            aid = f"{mode}:{rid}"
            common = {"cat": "request", "pid": pid, "tid": 0, "id": aid}
            events.append({"ph": "b", "name": rid, "ts": _us(S[arrival]), **common,
                           "args": {"arrival_step": arrival, "finish_step": finish,
                                    "latency_steps": finish - arrival}})
            # Waiting spans: before the first segment and between segments (preempted).
            waits = []
            t = arrival
            for k, seg in enumerate(segs):
                if seg["start"] > t:
                    waits.append(("queued" if k == 0 else "preempted", t, seg["start"]))
                t = seg["end"]
            for name, a, b in waits:
                events.append({"ph": "b", "name": name, "ts": _us(S[a]), **common,
                               "args": {"start_step": a, "end_step": b}})
                events.append({"ph": "e", "name": name, "ts": _us(S[b]), **common})
            events.append({"ph": "e", "name": rid, "ts": _us(S[finish]), **common})

        tl = res.timeline
        for step in range(res.steps):
            ts = _us(S[step])
            events.append({"ph": "C", "name": "requests", "pid": pid, "tid": 0, "ts": ts,
                           "args": {"running": tl["running"][step],
                                    "waiting": tl["waiting"][step],
                                    "preempted": tl["preempted"][step]}})
            events.append({"ph": "C", "name": "kv_blocks_used", "pid": pid, "tid": 0,
                           "ts": ts, "args": {"blocks": tl["kv_blocks_used"][step]}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "iterserve lab", "time": "simulated (cost model)"}}


def write_trace(results: dict[str, SimResult], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(results), f, separators=(",", ":"))
