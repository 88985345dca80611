"""The `slo` policy on the real engine (tiny random-weight model): the step-time model is fed
the measured steps, and an unattainable TTFT target is refused at add_request."""

from __future__ import annotations

import pytest

from iterserve.core.request import SamplingParams
from iterserve.engine.args import EngineArgs
from iterserve.engine.llm_engine import LLMEngine
from iterserve.errors import QueueFullError, SLOUnattainableError

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), num_kv_blocks=64, max_model_len=256,
        scheduling_policy="slo", **kw))


def test_serves_and_learns_the_measured_step_times(tiny_model_dir):
    engine = make_engine(tiny_model_dir, slo_ttft_ms=60_000.0, slo_tpot_ms=60_000.0)
    for i in range(4):
        engine.add_request(f"r{i}", "Hello world", SamplingParams(max_tokens=8, **GREEDY))
    done = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == ["r0", "r1", "r2", "r3"]
    assert all(len(o.outputs[0].token_ids) == 8 for o in done.values())
    slo = engine.scheduler.slo
    assert slo.model.num_observed >= 8 and slo.model.last_seconds > 0


def test_an_unattainable_ttft_is_refused_and_nothing_leaks(tiny_model_dir):
    # A 1 ms target: no prompt of ~200 tokens prefills that fast on a CPU.
    engine = make_engine(tiny_model_dir, slo_ttft_ms=1.0)
    engine.add_request("warm", [5, 6], SamplingParams(max_tokens=24, **GREEDY))
    while engine.has_unfinished_requests():      # measured steps: it refuses none before
        engine.step()
    assert engine.scheduler.slo.model.num_observed >= 20
    free = engine.scheduler.stats().num_free_blocks
    with pytest.raises(SLOUnattainableError) as exc:
        engine.add_request("big", list(range(3, 203)), SamplingParams(max_tokens=4, **GREEDY))
    assert isinstance(exc.value, QueueFullError)
    assert exc.value.predicted_ttft_s > 0.001
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.stats().num_free_blocks == free


def _run_flood(model_dir, **kw):
    """6 batch requests decoding, then an urgent one: per-step scheduled tokens + outputs."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), num_kv_blocks=64, max_model_len=256, max_num_seqs=8,
        scheduling_policy="priority", **kw))
    sched = engine.scheduler
    steps = []
    orig = sched.schedule

    def schedule():
        out = orig()
        steps.append(dict(out.num_scheduled_tokens))
        return out

    sched.schedule = schedule
    for i in range(6):
        engine.add_request(f"b{i}", [5 + i, 6, 7], SamplingParams(max_tokens=12, **GREEDY),
                           priority=1)
    engine.step()
    engine.add_request("u", [9, 10, 11, 12], SamplingParams(max_tokens=4, **GREEDY), priority=0)
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].token_ids
    return steps, texts


def test_priority_less_urgent_tokens_caps_the_batch_steps_and_changes_no_token(tiny_model_dir):
    """The cap changes when batch requests run (at most 2 of their tokens per step while the
    urgent class is active, round robin), never what they compute: the same greedy tokens
    as without it, every request complete."""
    free_steps, free = _run_flood(tiny_model_dir)
    capped_steps, capped = _run_flood(tiny_model_dir, priority_less_urgent_tokens=2,
                                      priority_guard_steps=1000)
    assert capped == free and sorted(capped) == ["b0", "b1", "b2", "b3", "b4", "b5", "u"]
    assert all(len(t) == (4 if rid == "u" else 12) for rid, t in capped.items())
    after = capped_steps[1:]                      # from the urgent arrival on
    assert max(sum(n for r, n in s.items() if r != "u") for s in after) <= 2
    assert max(sum(n for r, n in s.items() if r != "u") for s in free_steps[2:]) == 6
    assert len(capped_steps) > len(free_steps)    # what the batch class pays: more steps


@pytest.mark.parametrize("grace, most_steps", [(2.0, 1), (0.0, None)])
def test_a_request_still_tokenising_between_steps_makes_the_next_step(tiny_model_dir, grace,
                                                                        most_steps):
    """AsyncEngine holds a step (up to add_grace) while a request is between add_request's
    entry and its queueing, so it is not left waiting for a whole step it just missed. A
    tokeniser made 0.4 s slow: with the grace, at most the step already in flight passes
    before the request is queued; without it (the control), the engine keeps stepping."""
    import asyncio
    import time

    from iterserve.engine.async_engine import AsyncEngine

    eng = AsyncEngine.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=512), add_grace=grace)
    sched = eng.engine.scheduler
    orig = eng._encode

    def slow(*a, **k):
        time.sleep(0.4)
        return orig(*a, **k)

    async def main():
        stream = await eng.generate([5, 6, 7], SamplingParams(max_tokens=400, **GREEDY),
                                    request_id="busy")
        n = 0
        async for _ in stream:                 # the engine is stepping
            n += 1
            if n == 3:
                break
        eng._encode = slow
        before = sched.step
        _, q = await eng.add_request("late", "Hello world", SamplingParams(max_tokens=1,
                                                                          **GREEDY))
        queued = next(e for e in (await eng.get_trace("late"))["events"]
                      if e["event"] == "queued")
        await eng.shutdown()
        return queued["step"] - before

    passed = asyncio.run(main())
    if most_steps is not None:
        assert passed <= most_steps
    else:
        assert passed >= 2
