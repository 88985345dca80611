"""`static` batching: a group of requests runs to completion before the next one starts.

For comparison with continuous batching on the same engine (the lab, the benchmarks): when
nothing runs, is preempted or swapped, up to `max_num_seqs` waiting requests form a group,
and nothing else is admitted until every member has finished. Members preempted by
recompute wait in the group, at its front, not in the queue.

Batching is a knob of its own, next to the queue order, so `StaticBatching` wraps the
fcfs, priority or slo policy and changes only where requests are admitted from and what may
preempt: the group's order, victims, holds and hooks are its base policy's.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from iterserve.core.policy import Policy, StepRules
from iterserve.core.request import Request
from iterserve.core.request_queue import FCFSQueue, RequestQueue


class StaticBatching:
    """Admission by whole groups, over a base policy (see the module docstring)."""

    def __init__(self, base: Policy, max_num_seqs: int) -> None:
        self.base = base
        self.max_num_seqs = max_num_seqs
        self.waiting = base.waiting
        self.swapped = base.swapped
        self.refusal_reason = base.refusal_reason
        self.slo = base.slo
        # Members of the current group not yet admitted (or requeued after preemption), and
        # the ids of all unfinished members.
        self.group = FCFSQueue()
        self.group_ids: set[str] = set()
        # The base decides everything but admission and its preemptions.
        self.check_request = base.check_request
        self.on_add = base.on_add
        self.holds = base.holds
        self.overtakes_swapped = base.overtakes_swapped
        self.victim = base.victim
        self.place = base.place
        self.end_step = base.end_step
        self.step_done = base.step_done

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.group)

    def waiting_requests(self) -> Iterable[Request]:
        return list(self.waiting) + list(self.group)

    def admission_queue(self, idle: bool) -> RequestQueue:
        """The group; when nothing runs and the last group has finished, the next one."""
        if idle and not self.group_ids:
            while len(self.group_ids) < self.max_num_seqs and self.waiting:
                req = self.waiting.pop()
                self.group.push(req)
                self.group_ids.add(req.request_id)
        return self.group

    def requeue(self, request: Request) -> None:
        self.group.push_front(request)

    def forget(self, request: Request) -> None:
        if not self.waiting.remove(request):
            self.group.remove(request)
        self.group_ids.discard(request.request_id)

    def urgent_victim(self, request: Request, candidates: Sequence[Request]) -> Request | None:
        return None          # a group member never preempts another for admission

    def begin_step(self, step: int, running: Sequence[Request]) -> StepRules:
        # Nothing is admitted mid-group, so no running member yields to a waiting request.
        rules = self.base.begin_step(step, running)
        if rules.yield_below is None:
            return rules
        return StepRules(None, rules.share_below, rules.share_tokens)

