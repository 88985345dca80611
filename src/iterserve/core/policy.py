"""What a scheduling policy decides, and the policy every other one refines (fcfs).

The scheduler (core/scheduler.py) is one loop that every policy shares: a step's token
budget, the running requests' chunks and the preemptions that make room for them, swap-in,
admission, the data handed to the executors. What differs between `fcfs`, `priority`, `slo`
and `static` batching is a handful of decisions, and the loop asks the policy for each of
them through the `Policy` protocol below, so it holds no `if policy == ...` of its own. Each
policy keeps its own state (its queues, its measurements); the loop passes what it needs as
arguments, and no policy holds a reference to the scheduler.

The decisions, by concern:

- **Queue order.** `waiting` (requests not admitted yet: a deque, a priority heap, a slack
  heap) and `swapped` (the order in which swapped-out requests resume) are the policy's
  queues; `place` puts an admitted request into the running list, whose order is the order
  in which the step's budget is handed out.
- **Admission.** `check_request` refuses a request the policy cannot honour (a latency
  target without the slo policy); `on_add` may refuse one it predicts it cannot serve in
  time (`QueueFullError`, recorded as `refusal_reason`); `admission_queue` is where the
  next request to admit comes from (static batching admits from its group); `holds` stops
  admission for this step; `overtakes_swapped` lets a waiting request start before swapped
  ones resume.
- **Victim choice.** `victim` is the running request preempted when KV blocks run out;
  `urgent_victim` is one a waiting request may preempt to be admitted (priority only).
- **Per-step hooks.** `begin_step` returns the step's `StepRules` (data, read by the loop
  without a call per request); `end_step` sees the finished `SchedulerOutput`; `step_done`
  is called when the executor has run it (the slo policy times the step in between).

Only the queue, not the loop, knows a policy's order, as in vLLM v1's request queues; the
loop's phases resemble mini-sglang's split of prefill admission and decode into managers,
kept here as parts of one scheduler so that preemption can cross them within a step.

The implementations: `FcfsPolicy` here (the default, and the base whose no-op hooks the
others inherit), `PriorityPolicy` (core/priority_policy.py), `SloPolicy`
(core/slo_policy.py) and `StaticBatching` (core/static_batching.py), which wraps any of the
three. `make_policy` (core/scheduler.py) picks them from a `SchedulerConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Protocol, Sequence

from iterserve.core.config import SchedulerConfig
from iterserve.core.request import Request
from iterserve.core.request_queue import FCFSQueue, PriorityQueue, RequestQueue
from iterserve.core.scheduler_output import SchedulerOutput
from iterserve.errors import SamplingParamsError

if TYPE_CHECKING:
    from iterserve.core.slo_policy import SloPolicy


@dataclass(frozen=True, slots=True)
class StepRules:
    """How a policy shapes one step, decided once when the step begins.

    Rules are data rather than a call per request because the loop visits every running
    request every step (the decode hot path); a request's `priority` is compared with them.

    - `yield_below`: running requests with a priority value above it (less urgent) are not
      scheduled this step; they keep their blocks and run again the next one.
    - `share_below` / `share_tokens`: requests with a priority value above `share_below`
      get at most `share_tokens` tokens this step between them; when the share runs out
      while some wait, those that ran go to the back of their class (round robin).
    """

    yield_below: int | None = None
    share_below: int | None = None
    share_tokens: int = 0


NO_RULES = StepRules()


class Policy(Protocol):
    """The decisions the scheduler's loop leaves to its policy (see the module docstring)."""

    waiting: RequestQueue
    swapped: RequestQueue
    # The reason a request refused by `on_add` is recorded with ("rejected" event).
    refusal_reason: str | None
    # The slo policy deciding (itself, or the one a wrapper delegates to), else None: the
    # lab installs its clock on it, the engine reports its counters.
    slo: SloPolicy | None

    # --- admission ------------------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Raise SamplingParamsError for what `request` asks and this policy cannot honour."""

    def on_add(self, request: Request) -> None:
        """A valid request is about to be queued: fill policy defaults, or refuse it by
        raising QueueFullError (a subclass saying why)."""

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet, wherever the policy keeps them."""

    def waiting_requests(self) -> Iterable[Request]:
        """Every request not admitted yet (for consistency checks; not the hot path)."""

    def admission_queue(self, idle: bool) -> RequestQueue:
        """The queue this step admits from (`idle`: nothing runs or is swapped)."""

    def requeue(self, request: Request) -> None:
        """Put a request preempted by recompute back at the front of where it waits."""

    def forget(self, request: Request) -> None:
        """`request` finished (any state, any reason): drop it from the policy's books."""

    def holds(self, request: Request, running: Sequence[Request]) -> bool:
        """True to admit nothing more this step, `request` (the next in order) included."""

    def overtakes_swapped(self, request: Request, head: Request) -> bool:
        """True when waiting `request` may start before `head`, the next swapped request
        to resume (otherwise swapped requests resume before new work starts)."""

    # --- victim choice --------------------------------------------------------------------
    def victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when a KV block is missing."""

    def urgent_victim(self, request: Request, candidates: Sequence[Request]) -> Request | None:
        """A candidate that waiting `request` may preempt to be admitted, or None."""

    # --- queue order ----------------------------------------------------------------------
    def place(self, running: list[Request], request: Request) -> None:
        """Insert an admitted or resumed request into `running` (the budget's order)."""

    # --- per-step hooks -------------------------------------------------------------------
    def begin_step(self, step: int, running: Sequence[Request]) -> StepRules:
        """The step starts (timeouts already expired): the rules for its requests."""

    def end_step(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """The step is scheduled (`requests`: every unfinished request, by id)."""

    def step_done(self, running: Sequence[Request]) -> None:
        """The executor has run the step; `running` is the batch before its finishes."""


def _arrival(r: Request) -> tuple:
    return (r.arrival_time, r.request_id)


class FcfsPolicy:
    """First come, first served; preempted requests go back to the very front.

    The base of the other policies: its hooks do nothing, so a policy overrides only the
    decisions it changes, and the loop's cost under fcfs is a few no-op calls per step."""

    refusal_reason: str | None = None
    slo = None

    def __init__(self, config: SchedulerConfig) -> None:
        # How the config spells the policy (an enum or, unvalidated, a string): messages.
        self.name = str(getattr(config.scheduling_policy, "value", config.scheduling_policy))
        self.waiting: RequestQueue = FCFSQueue()
        self.swapped: RequestQueue = PriorityQueue(use_priority=False)   # by arrival

    def check_request(self, request: Request) -> None:
        # A latency target only the slo policy honours: refused, never silently ignored.
        if request.ttft_slo_ms is not None or request.tpot_slo_ms is not None:
            f = "ttft_slo_ms" if request.ttft_slo_ms is not None else "tpot_slo_ms"
            raise SamplingParamsError(
                f"{f} needs a server started with --scheduling-policy slo (this one "
                f"schedules {self.name})", f)

    def on_add(self, request: Request) -> None:
        pass

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def waiting_requests(self) -> Iterable[Request]:
        return list(self.waiting)

    def admission_queue(self, idle: bool) -> RequestQueue:
        return self.waiting

    def requeue(self, request: Request) -> None:
        self.waiting.push_front(request)

    def forget(self, request: Request) -> None:
        self.waiting.remove(request)

    def holds(self, request: Request, running: Sequence[Request]) -> bool:
        return False

    def overtakes_swapped(self, request: Request, head: Request) -> bool:
        return False

    def victim(self, running: Sequence[Request]) -> Request:
        """The latest arrival."""
        return max(running, key=_arrival)

    def urgent_victim(self, request: Request, candidates: Sequence[Request]) -> Request | None:
        return None

    def place(self, running: list[Request], request: Request) -> None:
        running.append(request)

    def begin_step(self, step: int, running: Sequence[Request]) -> StepRules:
        return NO_RULES

    def end_step(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        pass

    def step_done(self, running: Sequence[Request]) -> None:
        pass
