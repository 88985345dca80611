"""The `priority` policy: lower `priority` value first, and urgent work does not wait.

vLLM's priority policy orders the queues by (priority, arrival) and, when slots or KV blocks
run out, preempts a less urgent running request for a more urgent waiting one. That alone
leaves an urgent request arriving in a batch flood waiting behind the batch's prefill chunks,
then prefilling in a step full of batch work. On top of vLLM's order and preemption this
policy therefore

- keeps the running list in priority order (`place`), so the step's budget goes to the most
  urgent first;
- makes running requests less urgent than the head of the waiting queue sit out one step
  (`StepRules.yield_below`): the urgent prefill gets a step as cheap as it would be alone,
  the batch class pays one step per urgent admission;
- with `priority_less_urgent_tokens`, while a more urgent class is active (running, waiting,
  or seen in the last `priority_guard_steps` steps) caps what the less urgent requests get
  per step in all (`StepRules.share_*`, in turn), because a step already running cannot be
  interrupted: short steps bound an arriving urgent request's wait.
"""

from __future__ import annotations

from typing import Sequence

from iterserve.core.config import SchedulerConfig
from iterserve.core.policy import NO_RULES, FcfsPolicy, StepRules
from iterserve.core.request import Request
from iterserve.core.request_queue import PriorityQueue


def _urgency(r: Request) -> tuple:
    """Larger is less urgent: priority value, then arrival (ties by id)."""
    return (r.priority, r.arrival_time, r.request_id)


class PriorityPolicy(FcfsPolicy):
    """Most urgent first; preempted requests go to the front of their class."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.waiting = PriorityQueue()
        self.swapped = PriorityQueue(use_priority=True)
        self.share_tokens = config.priority_less_urgent_tokens
        self.guard_steps = config.priority_guard_steps
        # The most urgent class seen lately and the step it was last seen.
        self._urgent: tuple[int, int] | None = None

    def overtakes_swapped(self, request: Request, head: Request) -> bool:
        return request.priority < head.priority

    def victim(self, running: Sequence[Request]) -> Request:
        """The least urgent: lowest priority, then the latest arrival."""
        return max(running, key=_urgency)

    def urgent_victim(self, request: Request, candidates: Sequence[Request]) -> Request | None:
        """The least urgent candidate, if it is strictly less urgent than `request`."""
        if not candidates:
            return None
        victim = max(candidates, key=_urgency)
        return victim if victim.priority > request.priority else None

    def place(self, running: list[Request], request: Request) -> None:
        """After the last request of equal or higher urgency, so the budget is handed out in
        priority order (an urgent decode never waits for budget behind a batch prefill
        chunk); admission order within a class."""
        if running and running[-1].priority > request.priority:
            p = request.priority
            i = len(running)
            while i > 0 and running[i - 1].priority > p:
                i -= 1
            running.insert(i, request)
        else:
            running.append(request)

    def begin_step(self, step: int, running: Sequence[Request]) -> StepRules:
        share_below, share = self._share(step, running) if self.share_tokens else (None, 0)
        yield_below = self._yield_to(running)
        if share_below is None and yield_below is None:
            return NO_RULES
        return StepRules(yield_below, share_below, share)

    def _share(self, step: int, running: Sequence[Request]) -> tuple[int | None, int]:
        """(priority, tokens): requests less urgent than `priority` share `tokens` this step;
        (None, 0) when no more urgent class is active.

        The most urgent class present (running, whose list is in priority order, or at the
        head of the waiting queue) is remembered with the step; it stays active for
        priority_guard_steps steps after it was last seen, so a class whose requests come
        one at a time finds short steps when the next one arrives, not a full batch step
        in flight."""
        p_now = running[0].priority if running else None
        head = self.waiting.peek() if self.waiting else None
        if head is not None and (p_now is None or head.priority < p_now):
            p_now = head.priority
        u = self._urgent
        if u is not None and step - u[1] > self.guard_steps:
            u = None
        if p_now is not None and (u is None or p_now <= u[0]):
            u = (p_now, step)
        self._urgent = u
        if u is None:
            return None, 0
        return u[0], self.share_tokens

    def _yield_to(self, running: Sequence[Request]) -> int | None:
        """The priority that running requests of a lower one yield to this step, or None.

        When the head of the waiting queue is strictly more urgent than some running
        request (and than the head of the swapped queue, which would otherwise resume
        first), the less urgent running requests are not scheduled for this one step."""
        if not self.waiting or not running:
            return None
        head = self.waiting.peek()
        if head is None:
            return None
        if self.swapped:
            s = self.swapped.peek()
            if s is not None and s.priority <= head.priority:
                return None
        p = head.priority
        for r in running:
            if r.priority > p:
                return p
        return None
