"""The sizes of everything the engine keeps per request or per step (what a soak checks).

A long-running server must hold O(live requests) plus fixed bounds, whatever it has served.
`sizes(engine)` lists every such structure in one flat dict, so a soak can report them next to
RSS and a test can assert, after N requests have come and gone, that each is back to its
baseline (per-request maps) or under its bound (rings, caches). Two kinds:

- per-request (`*.live`, `*_requests`, ...): 0 when the engine is idle;
- bounded (`tracer.finished_traces` <= max_finished_requests, `tracer.step_history` <=
  step_history_len, `structured.cache` <= its cache_size, prefix-cache blocks <= num_blocks).

`sizes` reads plain attributes and never changes anything; call it on the engine thread
(AsyncEngine.run_in_engine) while the engine runs. Attributes a part does not have (a fake
executor, an engine wired by hand) are simply left out.
"""

from __future__ import annotations

from typing import Any


def _len(obj: Any, *names: str) -> int | None:
    for name in names:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    try:
        return len(obj)
    except TypeError:
        return None


def sizes(engine: Any) -> dict[str, int]:
    """Sizes of an LLMEngine's (or an AsyncEngine's) bookkeeping, flat: `part.structure`."""
    out: dict[str, int | None] = {}
    llm = getattr(engine, "engine", engine)         # AsyncEngine -> its LLMEngine
    if llm is not engine:
        out["async.streams"] = _len(engine, "_streams")
        out["async.health_violations"] = _len(engine, "health_violations")

    op = getattr(llm, "output_processor", None)
    if op is not None:
        out["output.requests"] = _len(op, "requests")
        out["output.seqs"] = _len(op, "_seqs")
        out["output.changed"] = _len(op, "_changed")
        out["output.matchers"] = _len(op, "_matchers")

    tr = getattr(llm, "tracer", None)
    if tr is not None:
        out["tracer.finished_traces"] = _len(tr, "_finished")
        out["tracer.step_history"] = _len(tr, "history")
        out["tracer.stat_loggers"] = _len(tr, "stat_loggers")

    ip = getattr(llm, "input_processor", None)
    comp = getattr(ip, "_compiler", None) if ip is not None else None
    if comp is not None:
        out["structured.cache"] = _len(comp, "_cache")
        out["structured.inflight"] = _len(comp, "_inflight")

    s = getattr(llm, "scheduler", None)
    if s is not None:
        out["scheduler.requests"] = _len(s, "requests")
        out["scheduler.running"] = _len(s, "running")
        out["scheduler.waiting"] = _len(s, "waiting")
        out["scheduler.waiting_entries"] = _len(s, "waiting", "_dq") \
            if _len(s, "waiting", "_dq") is not None else _len(s, "waiting", "_heap")
        out["scheduler.swapped"] = _len(s, "swapped")
        out["scheduler.sent"] = _len(s, "_sent")
        out["scheduler.granted"] = _len(s, "_granted")
        out["scheduler.group_ids"] = _len(s, "policy", "group_ids")      # static batching
        out["scheduler.timeouts"] = _len(s, "_timeouts")
        out["scheduler.ended"] = _len(s, "_ended")
        out["scheduler.finished"] = _len(s, "_finished")
        bm = getattr(s, "block_manager", None)
        if bm is not None:
            out["blocks.tables"] = _len(bm, "tables")
            out["blocks.req_keys"] = _len(bm, "_req_keys")
            out["blocks.num_registered"] = _len(bm, "_num_registered")
            out["blocks.host_tables"] = _len(bm, "host_tables")
            out["blocks.cached"] = _len(bm, "_cached")
            out["blocks.block_key"] = _len(bm, "_block_key")
            out["blocks.num_blocks"] = getattr(bm, "num_blocks", None)
            out["blocks.free"] = getattr(bm, "num_free_blocks", None)

    ex = getattr(llm, "executor", None)
    if ex is not None:
        out["executor.requests"] = _len(ex, "requests")

    for sl in getattr(tr, "stat_loggers", ()) or ():
        reg = getattr(sl, "registry", None)
        if reg is not None and hasattr(reg, "collect"):
            out["prometheus.samples"] = sum(len(m.samples) for m in reg.collect())
    return {k: v for k, v in out.items() if v is not None}


PER_REQUEST = ("async.streams", "output.requests", "output.seqs", "output.changed",
               "output.matchers", "structured.inflight", "scheduler.requests",
               "scheduler.running", "scheduler.waiting", "scheduler.swapped", "scheduler.sent",
               "scheduler.granted", "scheduler.group_ids", "scheduler.ended",
               "blocks.tables", "blocks.req_keys", "blocks.num_registered",
               "blocks.host_tables")
"""The structures that hold only live requests: all 0 once the engine is idle (after the
step that emits the last finished output). The runner's per-request states
(`executor.requests`) are dropped when a SchedulerOutput lists the request as finished, i.e.
in the step after it finished: when the engine goes idle, the requests that finished in its
last step (`scheduler.finished`) may linger until the next step, never more."""


def leftovers(s: dict[str, int]) -> dict[str, int]:
    """The per-request structures of a `sizes()` snapshot of an idle engine that are not
    back to their baseline ({} when none)."""
    out = {k: s[k] for k in PER_REQUEST if s.get(k)}
    if s.get("executor.requests", 0) > s.get("scheduler.finished", 0):
        out["executor.requests"] = s["executor.requests"]
    return out
