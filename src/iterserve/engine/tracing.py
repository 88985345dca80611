"""What the engine remembers for people: request traces, step history, the stats snapshot.

- A request's trace is its sequences' lifecycle events (from `Request.trace()`), with times
  relative to arrival, finish reasons and metrics; GET /v1/requests/{id}/trace serves it.
  Live requests are traced on demand; finished ones are traced once, when they retire, into
  a bounded ring (`max_finished_requests`), oldest dropped first.
- The step history (`step_history_len` steps that did something) and the snapshot are the
  live view's (GET /v1/engine/stats).
- Every step's StepStats goes to the stat loggers (the Prometheus exporter); a logger that
  raises is logged and skipped for that step, never allowed to fail requests.

Nothing here changes what the engine computes: it only reads request state.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from iterserve.core.request import Request
from iterserve.core.scheduler import SchedulerStats
from iterserve.engine.metrics import RequestMetrics, StatLogger, StepStats, merge_metrics
from iterserve.engine.request_state import RequestState

logger = logging.getLogger(__name__)


def count_token(stats: StepStats, state: RequestState, req: Request,
                index: int | None = None) -> None:
    """Add output token `index` of `req` (default: its last; the scheduler has appended it)
    to the step's stats. A step that verified drafts adds several, the ones after the
    first with no gap (they came in the same step)."""
    stats.num_generation_tokens += 1
    times = req.token_times
    i = len(times) - 1 if index is None else index
    if i == 0 and req.first_token_time is not None:
        stats.time_to_first_tokens.append(req.first_token_time - req.arrival_time)
        if not state.counted_prompt:
            state.counted_prompt = True
            stats.num_prompt_tokens += req.num_prompt_tokens
    elif 1 <= i < len(times):
        stats.inter_token_latencies.append(times[i] - times[i - 1])


class Tracer:
    def __init__(self, *, model_name: str, clock: Callable[[], float] = time.monotonic,
                 max_finished_requests: int = 1000, step_history_len: int = 300,
                 stat_loggers: Sequence[StatLogger] = ()) -> None:
        self.model_name = model_name
        self.clock = clock
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        self.history: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=step_history_len)
        self._finished: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._max_finished = max_finished_requests

    # --- request traces ------------------------------------------------------------------
    def trace(self, state: RequestState) -> dict[str, Any]:
        now = self.clock()
        seq_traces = []
        for seq in state.seqs:
            t = seq.request.trace()
            for ev in t["events"]:
                ev["t"] = ev["time"] - state.arrival_time
            if seq.finish_reason is not None:
                t["finish_reason"] = seq.finish_reason.value
            t["index"] = seq.index
            t["metrics"] = RequestMetrics.from_request(seq.request, now).to_dict()
            seq_traces.append(t)
        trace = dict(seq_traces[0])
        trace["request_id"] = state.request_id
        trace["model"] = self.model_name
        trace["arrival_wall_time"] = state.arrival_wall_time
        trace["n"] = len(state.seqs)
        trace["finished"] = state.finished
        if state.error:
            trace["error"] = state.error
        if len(state.seqs) > 1:
            trace["output_tokens"] = sum(t["output_tokens"] for t in seq_traces)
            trace["num_preemptions"] = sum(t["num_preemptions"] for t in seq_traces)
            trace["metrics"] = merge_metrics(
                [RequestMetrics.from_request(s.request, now) for s in state.seqs]).to_dict()
            trace["sequences"] = seq_traces
        return trace

    def retire(self, states: Iterable[RequestState]) -> None:
        """Keep the final traces of finished requests (the newest max_finished_requests)."""
        for state in states:
            self._finished[state.request_id] = self.trace(state)
            self._finished.move_to_end(state.request_id)
        while len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)

    def get_trace(self, request_id: str, live: Mapping[str, RequestState]
                  ) -> dict[str, Any] | None:
        state = live.get(request_id)
        if state is not None:
            return self.trace(state)
        return self._finished.get(request_id)

    def recent_traces(self, live: Mapping[str, RequestState], limit: int = 20
                      ) -> list[dict[str, Any]]:
        """The `limit` most recent requests, live ones first (newest first)."""
        live_traces = [self.trace(s) for _, s in zip(range(limit), reversed(live.values()))]
        done = [t for _, t in zip(range(limit - len(live_traces)),
                                  reversed(self._finished.values()))]
        return live_traces + done

    # --- steps ---------------------------------------------------------------------------
    def record_step(self, stats: StepStats, sched: SchedulerStats, *, active: bool) -> None:
        """Finish a step's StepStats with the scheduler's counts, remember the step when it
        did something (`active`), and hand the stats to every stat logger."""
        stats.num_running, stats.num_waiting = sched.num_running, sched.num_waiting
        stats.num_swapped, stats.kv_cache_usage = sched.num_swapped, sched.kv_usage
        stats.spec_decoding = getattr(sched, "spec_decoding", None)
        if active:
            self.history.append({
                "step": stats.step, "time": time.time(),
                "num_batched_tokens": stats.num_batched_tokens,
                "num_running": sched.num_running, "num_waiting": sched.num_waiting,
                "num_swapped": sched.num_swapped, "kv_cache_usage": sched.kv_usage,
            })
        for sl in self.stat_loggers:
            try:
                sl.log(stats)
            except Exception:
                logger.exception("stat logger %r failed", sl)

    def snapshot(self, sched: SchedulerStats, live: Mapping[str, RequestState]
                 ) -> dict[str, Any]:
        """The live view's snapshot (GET /v1/engine/stats)."""
        return {
            "model": self.model_name,
            "step": sched.step,
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "num_swapped": sched.num_swapped,
            "kv_cache_usage": sched.kv_usage,
            "num_free_blocks": sched.num_free_blocks,
            "num_blocks": sched.num_blocks,
            "num_preemptions_total": sched.num_preemptions_total,
            **({"spec_decode": sched.spec_decoding_total.to_dict()}
               if getattr(sched, "spec_decoding_total", None) is not None else {}),
            "history": list(self.history),
            "recent_requests": self.recent_traces(live, 20),
        }
