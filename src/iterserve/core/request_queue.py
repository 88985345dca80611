"""Waiting-queue policies: FCFS (a deque) and priority (a heap), behind one small interface.

The scheduler asks a queue for its head, pops it when admitted, pushes preempted requests
back at the front of their class, and removes requests that are aborted or time out while
waiting. Removal is lazy (an entry stays in the deque/heap but is skipped when it reaches
the head) so that a burst of aborts or queue timeouts costs O(1) each instead of O(queue);
every entry carries a sequence number, and an entry is live only while it is the latest one
pushed for its request, so a request that is removed and pushed again is never seen twice.

As in vLLM v1's `request_queue.py`, the scheduler does not know which order it runs: each
policy (core/policy.py) keeps its own queues, and `make_queue` names the two plain ones.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator

from iterserve.core.request import Request


class RequestQueue:
    """Common bookkeeping: which entry (by sequence number) is live for each request id."""

    __slots__ = ("_live", "_seq")

    def __init__(self) -> None:
        self._live: dict[str, int] = {}
        self._seq = 0

    def _next_seq(self, request: Request) -> int:
        self._seq += 1
        self._live[request.request_id] = self._seq
        return self._seq

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._live

    def remove(self, request: Request) -> bool:
        """Forget `request` (O(1)); returns whether it was queued."""
        return self._live.pop(request.request_id, None) is not None

    # Implemented by the policies.
    def push(self, request: Request) -> None:
        raise NotImplementedError

    def push_front(self, request: Request) -> None:
        raise NotImplementedError

    def peek(self) -> Request | None:
        raise NotImplementedError

    def pop(self) -> Request:
        request = self.peek()
        if request is None:
            raise IndexError("pop from an empty request queue")
        del self._live[request.request_id]
        self._drop_head()
        return request

    def take(self, request: Request) -> None:
        """Admit `request` from anywhere in the queue (pop() for a request not at the head:
        the scheduler passes over a long prompt for shorter ones behind it)."""
        if not self.remove(request):
            raise KeyError(request.request_id)

    def _drop_head(self) -> None:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError


class FCFSQueue(RequestQueue):
    """First come, first served; preempted requests go back to the very front."""

    __slots__ = ("_dq",)

    def __init__(self) -> None:
        super().__init__()
        self._dq: deque[tuple[int, Request]] = deque()

    def push(self, request: Request) -> None:
        self._dq.append((self._next_seq(request), request))

    def push_front(self, request: Request) -> None:
        self._dq.appendleft((self._next_seq(request), request))

    def peek(self) -> Request | None:
        dq, live = self._dq, self._live
        while dq:
            seq, request = dq[0]
            if live.get(request.request_id) == seq:
                return request
            dq.popleft()                      # a stale entry of a removed request
        return None

    def _drop_head(self) -> None:
        self._dq.popleft()

    def __iter__(self) -> Iterator[Request]:
        live = self._live
        return (r for s, r in self._dq if live.get(r.request_id) == s)


class PriorityQueue(RequestQueue):
    """Most urgent first (lower `priority` value), then earlier arrival.

    A preempted request is pushed to the front of its priority class: it keeps precedence
    over every request of the same priority that has not run yet, so under thrash it is not
    starved by newer arrivals. With `use_priority=False` the order is by arrival only (used
    for the swapped queue under FCFS).
    """

    __slots__ = ("_heap", "_use_priority")

    def __init__(self, use_priority: bool = True) -> None:
        super().__init__()
        self._heap: list[tuple] = []
        self._use_priority = use_priority

    def _key(self, request: Request, front: bool) -> tuple:
        prio = request.priority if self._use_priority else 0
        return (prio, 0 if front else 1, request.arrival_time, request.request_id)

    def push(self, request: Request) -> None:
        seq = self._next_seq(request)
        heapq.heappush(self._heap, (*self._key(request, False), seq, request))

    def push_front(self, request: Request) -> None:
        seq = self._next_seq(request)
        heapq.heappush(self._heap, (*self._key(request, True), seq, request))

    def peek(self) -> Request | None:
        heap, live = self._heap, self._live
        while heap:
            entry = heap[0]
            request = entry[-1]
            if live.get(request.request_id) == entry[-2]:
                return request
            heapq.heappop(heap)
        return None

    def _drop_head(self) -> None:
        heapq.heappop(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Live requests in queue order (sorts: for stats and tests, not the hot path)."""
        live = self._live
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:-1])
                if live.get(e[-1].request_id) == e[-2])


def make_queue(policy: str) -> RequestQueue:
    """The waiting queue for a `SchedulerConfig.scheduling_policy` ('fcfs' or 'priority')."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown queue policy {policy!r} (expected 'fcfs' or 'priority')")
