"""The `slo` scheduling policy: admit by deadline, refuse early, hold before TPOT breaks.

Why: under overload FCFS makes every request late together (the queue grows, every TTFT
grows with it, and a batch admitted without limit pushes every decode past its TPOT target).
Goodput, the requests per second that meet both targets, then falls towards zero. This
policy spends the same capacity on requests that can still make it:

- **Order by slack.** The waiting queue (`SloQueue`) is a heap keyed by
  `TTFT deadline - predicted prefill time`; a request whose key has passed (it can no longer
  make its TTFT even if admitted at once) moves to a *late* tier, served FCFS when no
  on-time request waits or when the on-time head's slack covers the late one's prefill and
  one more admission (`late_may_go_first`; it is not dropped: its client still gets an
  answer, and sooner than after the overload). Requests
  without a TTFT target come after those with one; preempted requests go first, as in the
  other policies.
- **Refuse early.** `on_add` forecasts the TTFT of a new request (core/ttft_forecast.py:
  the scheduler's rules replayed over the running requests' remaining decodes and the queue
  ahead of it, then its own prefill next to the decodes still running), scales it by a high
  quantile of the recent actual / forecast ratios (`ErrorTracker`, learned from every
  admitted request's first token), and when that exceeds its target raises
  `SLOUnattainableError` (a `QueueFullError`, so the server answers 429) with the predicted
  wait as retry-after, instead of queueing it to be late and to make others late. A request
  whose slack puts it ahead of queued ones is refused too if it would make one of them miss
  a target it would have met: an admitted request is a promise.
- **Hold admission** when one more decode would make the predicted decode step exceed the
  tightest TPOT target of the running requests (and the candidate's), with headroom for the
  prefill chunks interleaved with decodes (`TPOT_HEADROOM`).

Predictions come from `StepTimeModel` (core/step_time.py), seeded from a cost model and
refitted from every step's measured time: the policy's `begin_step` (in `schedule()`) and
`step_done` (in `update_from_output()`) hooks bracket the executor, so the real engine and the lab's
simulated executor feed it through the same code. Times are seconds on `self.clock`: the
scheduler's clock by default (wall time in the engine); the lab, whose scheduler clock
counts steps, installs its simulated seconds with `use_clock`, and then a request's arrival
is the clock's reading when it is added.

A forecast sums many steps, so it scales the fit's typical step by the model's
`mean_bias` (recent measured over predicted seconds; above 1 when a loaded machine makes
step times skewed), except where a prompt's own cost is judged (the 400 for a prompt too
slow to prefill in time even on an idle engine).

What a client sees per token is the bracketed step plus the time between steps (output
processing, streaming, the engine loop): measured too, as `overhead_s` (an average of the
gaps between back-to-back steps; 0 in the lab, whose steps are back to back), and added to
every prediction.

Cost below capacity: per step, one pass over the scheduled chunks for the step's features
and one `observe` (~3 us); the admission-time work (hold check, refusal check) only runs
when a request waits, i.e. at or above capacity.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Callable, Iterator, Mapping, Sequence

from iterserve.core.config import SchedulerConfig
from iterserve.core.cost_model import load_cost_model
from iterserve.core.policy import NO_RULES, FcfsPolicy, StepRules
from iterserve.core.request import Request, RequestStatus
from iterserve.core.request_queue import RequestQueue
from iterserve.core.scheduler_output import SchedulerOutput
from iterserve.core.step_time import StepTimeModel, attention_pairs
from iterserve.core.ttft_forecast import ErrorTracker, Limits, Work, forecast
from iterserve.errors import SLOUnattainableError

TPOT_HEADROOM = 0.85        # a decode step may use 85% of the tightest TPOT target
RATE_TIME_CONSTANT_S = 30.0  # memory of the measured admission rate under saturation
MIN_RATE_EVIDENCE_S = 1.0    # saturated seconds seen before the rate is trusted
OVERHEAD_EWMA = 0.05         # memory (~20 steps) of the per-step time outside the step
DEFAULT_SEED_COST_MODEL = "smollm2-cpu"
MAX_RETRY_AFTER_S = 120.0    # Retry-After at most this (what OpenAI's SDKs wait for)
MIN_OBSERVED_TO_REFUSE = 20  # measured steps before predictions may refuse a request
BIG_BATCH = 32               # above this many sequences a step's shape is sampled ...
SAMPLE_EVERY = 4             # ... every 4th step
_INF = math.inf


def default_step_time_model(name: str = DEFAULT_SEED_COST_MODEL) -> StepTimeModel:
    """Seed from a cost model: a JSON file or a shipped name (core/data)."""
    return StepTimeModel.from_cost_model(load_cost_model(name))


def _work(r: Request) -> Work:
    """What is left of `r` for the forecast: tokens to compute before it samples (0 for a
    decode), output tokens to produce, its context, its TPOT target."""
    computed = r.num_computed_tokens
    n = len(r.all_token_ids) - computed
    prefill = n if n > 1 or computed < r.num_prompt_tokens else 0
    left = r.sampling_params.max_tokens - len(r.output_token_ids)
    tpot = r.tpot_slo_ms / 1000.0 if r.tpot_slo_ms is not None else _INF
    return Work(prefill, max(left, 1 if prefill else 0), computed, tpot)


class SloQueue(RequestQueue):
    """Waiting queue of the `slo` policy: front (preempted) < on-time by slack key < late."""

    __slots__ = ("_heap", "_late", "_policy", "_head_late", "num_popped")

    def __init__(self, policy: "SloPolicy") -> None:
        super().__init__()
        self._heap: list[tuple] = []            # (tier, key, seq, request); tier 0 = front
        self._late: deque[tuple[int, Request]] = deque()
        self._policy = policy
        self._head_late = False
        self.num_popped = 0

    def push(self, request: Request) -> None:
        key = self._policy.queue_key(request)
        seq = self._next_seq(request)
        heapq.heappush(self._heap, (1, key, seq, request))

    def push_front(self, request: Request) -> None:
        seq = self._next_seq(request)
        heapq.heappush(self._heap, (0, request.arrival_time, seq, request))

    def peek(self) -> Request | None:
        heap, live = self._heap, self._live
        now = None
        while heap:
            tier, key, seq, request = heap[0]
            if live.get(request.request_id) != seq:
                heapq.heappop(heap)
                continue
            if tier == 1 and key != _INF:
                if now is None:
                    now = self._policy.clock()
                if key < now:                       # can no longer make its TTFT
                    heapq.heappop(heap)
                    self._late.append((seq, request))
                    continue
            if tier == 1 and self._late:
                waiting_late = self._late_head()
                if waiting_late is not None and self._policy.late_may_go_first(
                        key, waiting_late, now if now is not None else self._policy.clock()):
                    self._head_late = True
                    return waiting_late
            self._head_late = False
            return request
        request = self._late_head()
        self._head_late = request is not None
        return request

    def _late_head(self) -> Request | None:
        late, live = self._late, self._live
        while late:
            seq, request = late[0]
            if live.get(request.request_id) == seq:
                return request
            late.popleft()
        return None

    def _drop_head(self) -> None:
        if self._head_late:
            self._late.popleft()
        else:
            heapq.heappop(self._heap)
        self.num_popped += 1

    def take(self, request: Request) -> None:
        super().take(request)
        self.num_popped += 1

    def num_ahead(self, key: float) -> int:
        """Live on-time (and front) requests that would be served before a new `key`."""
        live = self._live
        return sum(1 for t, k, s, r in self._heap
                   if (t == 0 or k <= key) and live.get(r.request_id) == s)

    @property
    def num_late(self) -> int:
        live = self._live
        return sum(1 for s, r in self._late if live.get(r.request_id) == s)

    def __iter__(self) -> Iterator[Request]:
        live = self._live
        ordered = [e[-1] for e in sorted(self._heap, key=lambda e: e[:3])
                   if live.get(e[-1].request_id) == e[2]]
        return iter(ordered + [r for s, r in self._late if live.get(r.request_id) == s])


class SloPolicy(FcfsPolicy):
    """The `slo` policy (see the module docstring); one per Scheduler.

    Otherwise fcfs: swapped requests resume by arrival, the latest arrival is the victim."""

    refusal_reason = "slo_unattainable"

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float],
                 model: StepTimeModel | None = None) -> None:
        super().__init__(config)
        self.config = config
        self.model = model if model is not None else default_step_time_model(
            config.slo_cost_model or DEFAULT_SEED_COST_MODEL)
        self.clock: Callable[[], float] = clock
        self._own_clock = False
        self.waiting = SloQueue(self)
        self._step = 0
        # The last step's shape (for predictions) and what is needed to time it.
        self._t0 = 0.0
        self._features = (0, 0, 0, 0, 0)
        self._last_seqs = 0
        self._last_kv = 0
        self._last_step_s = 0.0
        # Seconds per step spent outside schedule()..update_from_output() while the engine
        # had work (output processing, streaming, the loop itself): part of every token's
        # time that the step-time model, fitted to the bracketed step, does not see.
        self._t_done = -1.0
        self.overhead_s = 0.0
        self._saturated = False         # requests still waited when the last schedule() ended
        self._backlog = False
        self._popped_before = 0
        # Admission rate under saturation: exponentially decayed admissions / seconds.
        self._sat_admitted = 0.0
        self._sat_seconds = 0.0
        # The hold check's view of the running batch, built once per step when needed.
        self._hold_step = -1
        self._hold_seqs = 0
        self._hold_kv = 0
        self._hold_tpot = _INF
        self.num_refused = 0
        self.num_held_steps = 0
        # The running list as of the last step (the scheduler's list object; a request that
        # finished since has left the RUNNING state and is skipped).
        self._running: Sequence[Request] = ()
        self._limits = Limits(
            max_num_seqs=config.max_num_seqs, budget=config.max_num_batched_tokens,
            chunked=bool(config.enable_chunked_prefill),
            threshold=(config.long_prefill_token_threshold or 0)
            if config.enable_chunked_prefill else 0,
            max_partial=config.max_num_partial_prefills, tpot_headroom=TPOT_HEADROOM)
        # Admitted requests waiting for their first token: (request, arrival, forecast s,
        # target s); the actual TTFT is compared with the forecast (`errors`).
        self._forecasts: dict[str, tuple[Request, float, float, float | None]] = {}
        self.errors = ErrorTracker()

    @property
    def slo(self) -> "SloPolicy":
        return self

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Measure in seconds on `clock` instead of the scheduler's clock (the lab)."""
        self.clock = clock
        self._own_clock = True

    # --- predictions ------------------------------------------------------------------------
    def _chunk(self, n: int) -> int:
        cfg = self.config
        c = n
        if cfg.enable_chunked_prefill:
            t = cfg.long_prefill_token_threshold
            if t and c > t:
                c = t
                # max_long_prefill_tokens: the long prompts' chunks together (a long
                # prompt's chunk is at most this, next to no other long prefill)
                if cfg.max_long_prefill_tokens and c > cfg.max_long_prefill_tokens:
                    c = cfg.max_long_prefill_tokens
            room = cfg.max_num_batched_tokens - self._last_seqs
            c = min(c, max(room, 1))
        return max(c, 1)

    def prefill_time(self, n: int, decodes: int, kv: int, typical: bool = False) -> float:
        """Predicted seconds to prefill n tokens next to `decodes` running decodes (with
        `typical`, at the fit's typical step time, without the recent mean bias: what the
        prompt costs this engine, not what the machine's other load adds today)."""
        c = self._chunk(n)
        steps = -(-n // c)
        # Chunk k (1-based) attends to k * c tokens: c * c * steps * (steps + 1) / 2 pairs in
        # all, spread evenly over the steps.
        pairs = c * c * (steps + 1) / 2
        return steps * self._step_seconds(decodes + c, decodes + 1, kv + c * steps, c, pairs,
                                          typical)

    def late_may_go_first(self, key: float, late: Request, now: float) -> bool:
        """Whether the late tier's head may be admitted before the on-time head whose slack
        key is `key`: when that head could still start after the late one's prefill and
        one more admission (a slot freed, at the measured admission rate). Without this a
        late request waits for the first moment no on-time request does, which at a steady
        overload is when arrivals stop: measured at 3x capacity, two admitted requests
        waited 11 and 17 s for a 2 s target."""
        if key == _INF:
            return True                         # no target to keep: the late one goes first
        rate = self.admission_rate
        if rate is None:
            return False                        # how long a slot takes to free is unknown
        return key - now > self.prefill_time(late.num_prompt_tokens, 0, 0) + 1.0 / rate

    def queue_key(self, request: Request) -> float:
        """Latest start (scheduler seconds) at which `request` still makes its TTFT target."""
        if request.ttft_slo_ms is None:
            return _INF
        arrival = self.clock() if self._own_clock else request.arrival_time
        n = request.num_prompt_tokens
        return arrival + request.ttft_slo_ms / 1000.0 - self.prefill_time(n, 0, 0)

    @property
    def admission_rate(self) -> float | None:
        """Requests/s admitted while requests waited (None until enough was seen)."""
        if self._sat_seconds < MIN_RATE_EVIDENCE_S or self._sat_admitted <= 0:
            return None
        return self._sat_admitted / self._sat_seconds

    # --- hooks ------------------------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        pass                                    # latency targets are what this policy reads

    def on_add(self, request: Request) -> None:
        """Give `request` the configured default targets, then refuse it
        (SLOUnattainableError) if it cannot meet its TTFT target, or if queueing it ahead of
        others (a tighter slack) would make one of them miss a target it would have met."""
        if request.ttft_slo_ms is None:
            request.ttft_slo_ms = self.config.slo_ttft_ms
        if request.tpot_slo_ms is None:
            request.tpot_slo_ms = self.config.slo_tpot_ms
        slo_ms = request.ttft_slo_ms
        if slo_ms is None:
            return
        slo = slo_ms / 1000.0
        n = request.num_prompt_tokens
        # A seed from another machine must not refuse a fresh engine's work; nor is a request
        # refused by an idle engine (refusing it helps nobody, and its first token is what
        # teaches the correction again after a stretch of refusals).
        running = self._running_work()
        warm = self.model.num_observed >= MIN_OBSERVED_TO_REFUSE
        may_refuse = warm and bool(running or self.waiting)
        alone = self.prefill_time(n, 0, 0, typical=True)
        if warm and alone > slo:
            self.num_refused += 1
            raise SLOUnattainableError(
                f"request {request.request_id!r}: its prompt of {n} tokens takes ~{alone:.3f} s "
                f"to prefill on this engine, more than its ttft_slo_ms={slo_ms:g}",
                retry_after_s=None, predicted_ttft_s=alone, ttft_slo_s=slo)
        now = self.clock()
        arrival = now if self._own_clock else request.arrival_time
        spent = max(now - arrival, 0.0)          # tokenising, in the server
        ahead, behind = self._queue_around(self.queue_key(request))
        queue = [w for _, w in ahead] + [_work(request)] + [w for _, w in behind]
        horizon = slo + MAX_RETRY_AFTER_S
        first = forecast(running, queue, self._limits, self._step_seconds, horizon)
        factor = self.errors.factor()
        mine = spent + first[len(ahead)]
        # At the correction's resolution: a forecast below its floor is judged as the floor
        # (the correction was learned from such forecasts at that floor, see ErrorTracker).
        predicted = max(mine, self.errors.floor(slo)) * factor
        broken = None
        if may_refuse and predicted <= slo and behind:
            broken = self._breaks(behind, first[len(ahead) + 1:], running,
                                  [w for _, w in ahead + behind], len(ahead), factor, now)
        if may_refuse and (predicted > slo or broken is not None):
            self.num_refused += 1
            if broken is None:
                why = (f"predicted time to first token ~{min(predicted, horizon):.3f} s "
                       f"exceeds its ttft_slo_ms={slo_ms:g} (the engine is busy)")
                retry = predicted - slo
            else:
                why = (f"queued ahead of request {broken!r} (a tighter deadline), it would "
                       f"make that one miss its TTFT target")
                retry = mine * factor
            retry = min(max(retry, self._last_step_s, 0.001), MAX_RETRY_AFTER_S)
            raise SLOUnattainableError(
                f"request {request.request_id!r}: {why}; retry in ~{retry:.1f} s",
                retry_after_s=retry, predicted_ttft_s=predicted, ttft_slo_s=slo)
        # Admitted: remember the forecast (from arrival, unscaled) to compare with the actual;
        # one admitted unchecked (too few steps seen) was no promise, so it is reported but
        # does not move the correction (target None).
        self._forecasts[request.request_id] = (request, arrival, mine,
                                               slo if may_refuse else None)

    def _queue_around(self, key: float) -> tuple[list, list]:
        """The waiting requests a new one with slack `key` would be admitted after (front
        tier and on-time keys <= key) and before (later keys, then the late tier), each as
        (request, Work), in admission order."""
        ahead: list = []
        behind: list = []
        q = self.waiting
        live = q._live
        for t, k, seq, r in sorted(q._heap, key=lambda e: e[:3]):
            if live.get(r.request_id) != seq:
                continue
            (ahead if t == 0 or k <= key else behind).append((r, _work(r)))
        for seq, r in q._late:
            if live.get(r.request_id) == seq:
                behind.append((r, _work(r)))
        return ahead, behind

    def _breaks(self, behind: list, first_with: list[float], running: list,
                queue_without: list, pos: int, factor: float, now: float) -> str | None:
        """The id of a request behind the new one that would miss its target because of
        it, though it would make it without (None: nobody)."""
        late = []
        for (r, _), f in zip(behind, first_with):
            entry = self._forecasts.get(r.request_id)
            if entry is None or entry[3] is None:
                continue                        # a preempted or late one: no promise held
            _, arrival, _, target = entry
            if max(now - arrival + f, self.errors.floor(target)) * factor > target:
                late.append((r, arrival, target))
        if not late:
            return None
        without = forecast(running, queue_without, self._limits, self._step_seconds,
                           max(t for _, _, t in late) + 1.0)[pos:]
        index = {r.request_id: i for i, (r, _) in enumerate(behind)}
        for r, arrival, target in late:
            wait = now - arrival + without[index[r.request_id]]
            if max(wait, self.errors.floor(target)) * factor <= target:
                return r.request_id
        return None

    def _running_work(self) -> list[Work]:
        out = []
        for r in self._running:
            if r.status is RequestStatus.RUNNING:
                out.append(_work(r))
        return out

    def _step_seconds(self, tokens, seqs, kv, prefill, pairs=0.0, typical=False) -> float:
        """Expected seconds of a step of this shape as a client sees it: the fit's typical
        step times its recent mean bias (`StepTimeModel.mean_bias`: a sum of steps is
        their mean times their count; not with `typical`), plus the time between steps."""
        s = self.model.predict(tokens, seqs, kv, prefill, pairs)
        return (s if typical else s * self.model.mean_bias) + self.overhead_s

    def begin_step(self, step: int, running: Sequence[Request]) -> StepRules:
        """Stamp the step's start (`step_done` times it) and measure the gap since the
        last one ended."""
        self._step = step
        self._t0 = t0 = self.clock()
        if self._forecasts:
            self._record_first_tokens(t0)
        if self._t_done >= 0.0:                 # the last step left work: back to back
            gap = t0 - self._t_done
            if 0.0 <= gap < max(4 * self._last_step_s, 0.05):   # not an idle wait
                self.overhead_s += OVERHEAD_EWMA * (gap - self.overhead_s)
            self._t_done = -1.0
        self._popped_before = self.waiting.num_popped
        # A step that starts with a backlog left by the previous one measures the service
        # rate: how fast waiting requests get in when they have to wait.
        self._backlog = self._saturated
        return NO_RULES

    def _record_first_tokens(self, now: float) -> None:
        """Admitted requests whose first token came in the last step: actual vs forecast
        TTFT (on this policy's clock: the lab's seconds too)."""
        done = [rid for rid, e in self._forecasts.items() if e[0].first_token_time is not None]
        for rid in done:
            _, arrival, predicted, target = self._forecasts.pop(rid)
            self.errors.record(predicted, now - arrival, target)

    def forget(self, request: Request) -> None:
        super().forget(request)
        self._forecasts.pop(request.request_id, None)

    def holds(self, request: Request, running: Sequence[Request]) -> bool:
        """True to stop admitting: one more decode would break the tightest TPOT target."""
        step = self._step
        if self._hold_step != step:
            self._hold_step = step
            kv = 0
            tpot = _INF
            for r in running:
                kv += len(r.all_token_ids)
                t = r.tpot_slo_ms
                if t is not None and t < tpot:
                    tpot = t
            self._hold_seqs, self._hold_kv, self._hold_tpot = len(running), kv, tpot
        tpot = self._hold_tpot
        t = request.tpot_slo_ms
        if t is not None and t < tpot:
            tpot = t
        seqs = self._hold_seqs
        if tpot == _INF or seqs == 0:
            ok = True
        else:
            n = len(request.all_token_ids)
            step_s = self._step_seconds(seqs + 1, seqs + 1, self._hold_kv + n, 0)
            ok = step_s <= TPOT_HEADROOM * tpot / 1000.0
        if not ok:
            self.num_held_steps += 1
            return True
        # Assume it is admitted (if not, the admission loop stops anyway).
        self._hold_seqs = seqs + 1
        self._hold_kv += len(request.all_token_ids)
        if t is not None and t < self._hold_tpot:
            self._hold_tpot = t
        return False

    def end_step(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """End of schedule(): remember the step's shape to time it in `step_done`.

        The shape costs a pass over the scheduled requests; in big batches (> BIG_BATCH
        sequences) only every SAMPLE_EVERY-th step is measured (their shapes change slowly)."""
        self._saturated = bool(self.waiting)
        scheduled = out.num_scheduled_tokens
        if len(scheduled) > BIG_BATCH and out.step % SAMPLE_EVERY:
            self._features = None
            return
        kv = prefill = pairs = 0
        for rid, n in scheduled.items():
            req = requests[rid]
            start = req.num_computed_tokens      # not advanced until update_from_output
            kv += start + n
            if n > 1 or start < len(req.prompt_token_ids):
                prefill += n
                pairs += attention_pairs(start, n)
        self._features = (out.num_batched_tokens, len(scheduled), kv, prefill, pairs)

    def step_done(self, running: Sequence[Request]) -> None:
        """update_from_output(): the executor has run; fold its measured time in."""
        now = self.clock()
        dt = now - self._t0
        self._running = running
        if running or self.waiting:
            self._t_done = now
        if self._features is not None:
            tokens, seqs, kv, prefill, pairs = self._features
            if seqs:
                self.model.observe(tokens, seqs, kv, prefill, dt, pairs)
                self._last_step_s = dt
            self._last_seqs = seqs
            self._last_kv = kv
        if dt > 0:
            admitted = self.waiting.num_popped - self._popped_before
            if self._backlog:
                d = math.exp(-dt / RATE_TIME_CONSTANT_S)
                self._sat_admitted = self._sat_admitted * d + admitted
                self._sat_seconds = self._sat_seconds * d + dt

    def stats(self) -> dict:
        return {"refused": self.num_refused, "held_steps": self.num_held_steps,
                "late_waiting": self.waiting.num_late, "admission_rate": self.admission_rate,
                "overhead_s": self.overhead_s, "ttft_forecast": self.errors.summary(),
                "step_time_model": self.model.coefficients}
