"""Waiting-queue policies: FCFS and priority, with front-of-class requeue and lazy removal."""

import pytest

from iterserve.core.request import Request
from iterserve.core.request_queue import FCFSQueue, PriorityQueue, make_queue


def r(rid, priority=0, t=0.0):
    return Request(rid, [1], priority=priority, arrival_time=t)


def drain(q):
    out = []
    while q:
        out.append(q.pop().request_id)
    return out


def test_fcfs_pops_in_arrival_order_and_preempted_go_to_the_front():
    q = FCFSQueue()
    for x in (r("a"), r("b"), r("c")):
        q.push(x)
    q.push_front(r("p"))
    assert drain(q) == ["p", "a", "b", "c"]


def test_removed_requests_are_skipped_and_can_be_pushed_again_once():
    q = FCFSQueue()
    a, b = r("a"), r("b")
    q.push(a)
    q.push(b)
    assert q.remove(a) and not q.remove(a)
    assert len(q) == 1 and q.peek() is b
    q.push_front(a)
    q.push(a)                                 # only the latest entry counts
    assert drain(q) == ["b", "a"]


def test_priority_queue_orders_by_priority_then_arrival():
    q = PriorityQueue()
    q.push(r("late-urgent", priority=0, t=5))
    q.push(r("early-lazy", priority=2, t=0))
    q.push(r("early-urgent", priority=0, t=1))
    assert drain(q) == ["early-urgent", "late-urgent", "early-lazy"]


def test_priority_preempted_request_goes_to_the_front_of_its_class_only():
    q = PriorityQueue()
    q.push(r("urgent", priority=0, t=9))
    q.push(r("same-class-earlier", priority=1, t=0))
    q.push_front(r("preempted", priority=1, t=5))
    assert drain(q) == ["urgent", "preempted", "same-class-earlier"]
    assert [x.request_id for x in q] == []


def test_iteration_lists_live_requests_in_queue_order():
    q = PriorityQueue()
    a, b = r("a", 1), r("b", 0)
    q.push(a)
    q.push(b)
    q.remove(b)
    assert list(q) == [a]


def test_make_queue_rejects_unknown_policy():
    assert isinstance(make_queue("fcfs"), FCFSQueue)
    with pytest.raises(ValueError, match="policy"):
        make_queue("lifo")
