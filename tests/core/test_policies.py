"""Each scheduling policy on its own (core/policy.py's protocol), and the loop's use of it.

The policies are driven here without a scheduler: a policy gets what it decides on as
arguments, so each decision (order, admission, victim, per-step rules and hooks) can be
checked by itself. The last tests plug a policy of their own into the Scheduler to show that
the loop asks the policy rather than knowing the policies.
"""

import inspect
import io
import tokenize

import pytest

from iterserve.core import scheduler as scheduler_module
from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.policy import NO_RULES, FcfsPolicy, StepRules
from iterserve.core.priority_policy import PriorityPolicy
from iterserve.core.request import Request, SamplingParams
from iterserve.core.scheduler import Scheduler, make_policy
from iterserve.core.scheduler_output import SchedulerOutput
from iterserve.core.slo_policy import SloPolicy, SloQueue
from iterserve.core.static_batching import StaticBatching
from iterserve.core.step_time import StepTimeModel
from iterserve.errors import SamplingParamsError

COST = dict(c0=0.010, c_tok=0.0, c_seq=0.002, c_kv=0.0, c_prefill_tok=0.001)


def cfg(**kw):
    return SchedulerConfig(**kw).validate()


def r(rid, priority=0, t=0.0, prompt_len=4, **kw):
    return Request(rid, [1] * prompt_len, SamplingParams(max_tokens=4), priority=priority,
                   arrival_time=t, **kw)


def ids(reqs):
    return [x.request_id for x in reqs]


# --- make_policy -----------------------------------------------------------------------------
@pytest.mark.parametrize("policy, batching, kind, base", [
    ("fcfs", "continuous", FcfsPolicy, None),
    ("priority", "continuous", PriorityPolicy, None),
    ("slo", "continuous", SloPolicy, None),
    ("priority", "static", StaticBatching, PriorityPolicy),
    ("slo", "static", StaticBatching, SloPolicy),
])
def test_make_policy_picks_the_configured_policy(policy, batching, kind, base):
    p = make_policy(cfg(scheduling_policy=policy, batching=batching), clock=lambda: 0.0)
    assert type(p) is kind
    if base is not None:
        assert type(p.base) is base
    assert (p.slo is not None) == (policy == "slo")


# --- fcfs ------------------------------------------------------------------------------------
def test_fcfs_orders_by_arrival_requeues_at_the_front_and_has_no_rules():
    p = FcfsPolicy(cfg())
    for x in (r("a", t=0), r("b", priority=-5, t=1), r("c", t=2)):
        p.waiting.push(x)
    p.requeue(r("victim", t=9))
    assert ids(p.waiting) == ["victim", "a", "b", "c"]      # priority ignored
    assert p.num_waiting == 4
    assert p.begin_step(0, []) is NO_RULES
    running = [r("x", t=0), r("late", priority=-9, t=5), r("y", t=1)]
    assert p.victim(running).request_id == "late"           # the latest arrival
    assert p.urgent_victim(r("u", priority=-9), running) is None
    assert not p.holds(r("u"), running)
    assert not p.overtakes_swapped(r("u", priority=-9), r("s", priority=5))
    placed: list[Request] = []
    for x in running:
        p.place(placed, x)
    assert placed == running                                # admission order


def test_fcfs_refuses_latency_targets_naming_the_field_and_its_policy():
    p = FcfsPolicy(cfg(scheduling_policy="priority"))
    with pytest.raises(SamplingParamsError, match="schedules priority") as e:
        p.check_request(r("a", tpot_slo_ms=50.0))
    assert e.value.param == "tpot_slo_ms"
    p.check_request(r("b"))                                 # no target: fine


def test_forget_drops_a_waiting_request():
    p = FcfsPolicy(cfg())
    a, b = r("a"), r("b")
    p.waiting.push(a)
    p.waiting.push(b)
    p.forget(a)
    p.forget(r("never-queued"))
    assert ids(p.waiting_requests()) == ["b"]


# --- priority --------------------------------------------------------------------------------
def test_priority_orders_queues_running_list_and_victims_by_urgency():
    p = PriorityPolicy(cfg(scheduling_policy="priority"))
    for x in (r("lazy", 2, 0), r("urgent-late", 0, 5), r("urgent", 0, 1)):
        p.waiting.push(x)
    assert ids(p.waiting) == ["urgent", "urgent-late", "lazy"]
    running: list[Request] = []
    for x in (r("b1", 1, 0), r("b2", 1, 1), r("u", 0, 2), r("l", 2, 3), r("u2", 0, 4)):
        p.place(running, x)
    assert ids(running) == ["u", "u2", "b1", "b2", "l"]     # by class, admission within
    assert p.victim(running).request_id == "l"
    assert p.victim(running[:4]).request_id == "b2"          # then the latest arrival
    assert p.overtakes_swapped(r("w", 0), r("s", 1))
    assert not p.overtakes_swapped(r("w", 1), r("s", 1))


def test_priority_urgent_victim_only_when_strictly_less_urgent():
    p = PriorityPolicy(cfg(scheduling_policy="priority"))
    batch = [r("b1", 1, 0), r("b2", 1, 3)]
    assert p.urgent_victim(r("u", 0), batch).request_id == "b2"
    assert p.urgent_victim(r("peer", 1), batch) is None
    assert p.urgent_victim(r("u", 0), []) is None


def test_priority_rules_less_urgent_running_requests_yield_to_an_urgent_head():
    p = PriorityPolicy(cfg(scheduling_policy="priority"))
    running = [r("batch", 1, 0)]
    assert p.begin_step(0, running) is NO_RULES              # nothing waits
    p.waiting.push(r("urgent", 0, 1))
    assert p.begin_step(1, running) == StepRules(yield_below=0)
    p.swapped.push(r("swapped-urgent", 0, 0))                # would resume first: no yield
    assert p.begin_step(2, running).yield_below is None


def test_priority_share_caps_the_less_urgent_while_an_urgent_class_is_active():
    p = PriorityPolicy(cfg(scheduling_policy="priority", priority_less_urgent_tokens=16,
                           priority_guard_steps=3))
    batch = [r("batch", 1, 0)]
    assert p.begin_step(0, batch) == StepRules(share_below=1, share_tokens=16)  # batch only
    assert p.begin_step(1, [r("u", 0, 1)] + batch) == StepRules(share_below=0, share_tokens=16)
    for step in (2, 3, 4):                                   # the urgent class is remembered
        assert p.begin_step(step, batch).share_below == 0
    assert p.begin_step(5, batch).share_below == 1           # ... for guard_steps steps


# --- static batching -------------------------------------------------------------------------
def test_static_forms_a_group_only_when_idle_and_the_last_group_finished():
    p = StaticBatching(FcfsPolicy(cfg()), max_num_seqs=2)
    reqs = [r(f"r{i}", t=i) for i in range(5)]
    for x in reqs:
        p.waiting.push(x)
    assert not p.admission_queue(idle=False)                 # something runs: no group
    group = p.admission_queue(idle=True)
    assert ids(group) == ["r0", "r1"] and p.num_waiting == 5
    group.pop()
    p.requeue(reqs[0])                                       # preempted: back to the group
    assert ids(group) == ["r0", "r1"]
    assert ids(p.admission_queue(idle=True)) == ["r0", "r1"]  # members unfinished: no new
    for x in reqs[:2]:
        p.forget(x)
    assert not group and ids(p.admission_queue(idle=True)) == ["r2", "r3"]


def test_static_never_yields_or_preempts_for_admission_but_keeps_its_base_order():
    p = StaticBatching(PriorityPolicy(cfg(scheduling_policy="priority",
                                          priority_less_urgent_tokens=8)), max_num_seqs=4)
    running = [r("batch", 1, 0)]
    p.waiting.push(r("urgent", 0, 1))
    assert p.begin_step(0, running) == StepRules(share_below=0, share_tokens=8)
    assert p.urgent_victim(r("urgent", 0), running) is None
    assert p.victim([r("a", 0, 0), r("b", 1, 0)]).request_id == "b"


# --- slo, without a scheduler ----------------------------------------------------------------
def slo(**kw):
    t = [0.0]
    p = SloPolicy(cfg(scheduling_policy="slo", max_num_batched_tokens=512, max_model_len=1024,
                      **kw), lambda: t[0], model=StepTimeModel(COST))
    return p, t


def test_slo_fills_default_targets_and_orders_by_slack():
    p, _ = slo(slo_ttft_ms=1000.0, slo_tpot_ms=50.0)
    assert isinstance(p.waiting, SloQueue) and p.slo is p
    assert not hasattr(p, "scheduler")
    a = r("default")
    p.check_request(r("target", ttft_slo_ms=10.0))           # targets are its business
    p.on_add(a)
    assert (a.ttft_slo_ms, a.tpot_slo_ms) == (1000.0, 50.0)
    tight = r("tight", ttft_slo_ms=200.0)
    p.on_add(tight)
    for x in (a, tight):
        p.waiting.push(x)
    assert ids(p.waiting) == ["tight", "default"]


def test_slo_holds_before_one_more_decode_breaks_the_tightest_tpot():
    """Decode step = 10 ms + 2 ms per sequence, 85% headroom: 10 running + 1 fit 40 ms
    (32 <= 34), 12 running + 1 do not (36 > 34)."""
    p, _ = slo()
    running = [r(f"r{i}", tpot_slo_ms=40.0) for i in range(10)]
    p.begin_step(0, running)
    assert not p.holds(r("a"), running)
    assert not p.holds(r("b"), running + [r("a")])           # the hold counts it admitted
    assert p.holds(r("c"), running + [r("a"), r("b")])
    assert p.num_held_steps == 1
    p.begin_step(1, running)                                 # a new step recounts
    assert not p.holds(r("d"), running)


def test_slo_times_the_step_between_its_hooks():
    p, t = slo()
    running = [r("a")]
    reqs = {"a": running[0]}
    for step in range(5):
        p.begin_step(step, running)
        out = SchedulerOutput(step=step, num_scheduled_tokens={"a": 1}, num_batched_tokens=1)
        p.end_step(out, reqs)
        t[0] += 0.012                                        # the executor's step
        p.step_done(running)
        t[0] += 0.003                                        # the engine between steps
    assert p.model.num_observed == 5
    assert p.overhead_s > 0


# --- the loop asks the policy ----------------------------------------------------------------
class EveryOther(FcfsPolicy):
    """A test policy: admits at most one request per step and records the hooks it got."""

    def __init__(self, config):
        super().__init__(config)
        self.calls: list[str] = []

    def begin_step(self, step, running):
        self.calls.append(f"begin {step}")
        self.admitted = False
        return NO_RULES

    def holds(self, request, running):
        return self.admitted

    def place(self, running, request):
        self.admitted = True
        running.insert(0, request)                           # newest first

    def end_step(self, out, requests):
        self.calls.append(f"end {out.step} {sorted(out.num_scheduled_tokens)}")

    def step_done(self, running):
        self.calls.append(f"done {len(running)}")


def test_a_policy_of_its_own_decides_admission_order_and_sees_every_hook():
    config = SchedulerConfig(max_num_seqs=8)
    policy = EveryOther(config)
    s = Scheduler(config, CacheConfig(block_size=4, num_kv_blocks=64), clock=lambda: 0.0,
                  policy=policy)
    for i in range(3):
        s.add_request(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=9, ignore_eos=True)))
    for _ in range(3):
        out = s.schedule()
        s.check_consistency()
        s.update_from_output(out, {rid: 5 for rid in out.num_scheduled_tokens})
    assert policy.calls == ["begin 0", "end 0 ['r0']", "done 1",
                            "begin 1", "end 1 ['r0', 'r1']", "done 2",
                            "begin 2", "end 2 ['r0', 'r1', 'r2']", "done 3"]
    assert list(out.num_scheduled_tokens) == ["r1", "r0", "r2"]   # the running list's order
    assert ids(s.running) == ["r2", "r1", "r0"]


def _code(obj) -> str:
    """Source without comments and docstrings (what the code itself names)."""
    src = inspect.getsource(obj)
    out = []
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            continue
        if tok.type == tokenize.STRING and prev in (tokenize.INDENT, tokenize.NEWLINE, None):
            continue
        if tok.type not in (tokenize.NL, tokenize.DEDENT):
            prev = tok.type
        out.append(tok.string)
    return " ".join(out)


def test_the_scheduler_loop_names_no_policy_and_schedule_stays_short():
    code = _code(scheduler_module.Scheduler)
    for name in ("SchedulingPolicy", "Batching", "SloPolicy", "PriorityPolicy",
                 "StaticBatching", "slo_policy", ". slo ."):
        assert name not in code, name
    assert len(inspect.getsource(Scheduler.schedule).splitlines()) <= 80
