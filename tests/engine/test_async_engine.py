"""AsyncEngine: background stepping, per-request streams, abort when the consumer leaves."""

from __future__ import annotations

import asyncio

import pytest

from iterserve.core.request import SamplingParams
from iterserve.engine.args import EngineArgs
from iterserve.engine.async_engine import AsyncEngine, EngineDeadError

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture
def aengine(tiny_model_dir):
    return AsyncEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), num_kv_blocks=64,
                                                   max_model_len=256))


def test_concurrent_streams_each_get_their_own_tokens(aengine):
    async def one(prompt):
        stream = await aengine.generate(prompt, SamplingParams(max_tokens=5, **GREEDY))
        outs = [o async for o in stream]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        return outs[-1].outputs[0].token_ids

    async def main():
        results = await asyncio.gather(*(one(f"prompt {i}") for i in range(4)))
        await aengine.shutdown()
        return results

    results = asyncio.run(main())
    assert all(len(r) == 5 for r in results)


def test_consumer_leaving_aborts_and_frees_blocks_within_one_step(aengine):
    sched = aengine.engine.scheduler

    async def main():
        total = sched.stats().num_blocks
        stream = await aengine.generate("Hello world", SamplingParams(max_tokens=200, **GREEDY),
                                        request_id="leaver")
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
                break                          # the consumer goes away mid-stream
        await stream.aclose()
        step_at_abort = sched.step
        for _ in range(200):
            if sched.stats().num_free_blocks == total:
                break
            await asyncio.sleep(0.005)
        freed_by = sched.step
        trace = await aengine.get_trace("leaver")
        await aengine.shutdown()
        return total, freed_by - step_at_abort, trace

    total, steps, trace = asyncio.run(main())
    assert sched.stats().num_free_blocks == total
    assert steps <= 1
    assert trace["finish_reason"] == "abort"


def test_cancelled_task_aborts_its_request(aengine):
    async def main():
        async def consume():
            stream = await aengine.generate("Hello", SamplingParams(max_tokens=200, **GREEDY),
                                            request_id="cancelled")
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        for _ in range(2000):
            req = aengine.engine.scheduler.get_request("cancelled")
            if task.done() or (req is not None and req.output_token_ids):
                break
            await asyncio.sleep(0.005)
        assert not task.done(), task.exception()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(200):
            if not aengine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.005)
        trace = await aengine.get_trace("cancelled")
        await aengine.shutdown()
        return trace

    trace = asyncio.run(main())
    assert trace["finish_reason"] == "abort"


def test_validation_errors_raise_before_streaming_and_loop_keeps_serving(aengine):
    async def main():
        with pytest.raises(ValueError):
            await aengine.generate("", SamplingParams())
        stream = await aengine.generate("Hi", SamplingParams(max_tokens=2, **GREEDY))
        outs = [o async for o in stream]
        await aengine.shutdown()
        with pytest.raises(EngineDeadError):
            await aengine.generate("Hi", SamplingParams())
        return outs

    assert asyncio.run(main())[-1].outputs[0].finish_reason == "length"


def test_shutdown_ends_in_flight_streams(aengine):
    # The cut stream ends like any other stream (not with EngineDeadError), with a final
    # output whose finish_reason is "abort".
    async def main():
        stream = await aengine.generate("Hi", SamplingParams(max_tokens=200, **GREEDY))
        await stream.__anext__()
        await aengine.shutdown()
        return [o async for o in stream]

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert not aengine.engine.has_unfinished_requests() or \
        not aengine.engine.scheduler.has_unfinished_requests()


def test_the_model_is_built_on_the_thread_that_steps_it(tiny_model_dir, monkeypatch):
    """One OpenMP team per process: loading on the main thread and stepping on the engine
    thread made two, and libgomp then stopped spinning between parallel regions (the server
    ran `mix` ~35% slower than offline)."""
    import threading

    from iterserve.engine.llm_engine import LLMEngine

    seen: dict[str, set[int]] = {"build": set(), "step": set()}
    build, step = LLMEngine.from_engine_args.__func__, LLMEngine.step

    def spy_build(cls, *a, **kw):
        seen["build"].add(threading.get_ident())
        return build(cls, *a, **kw)

    def spy_step(self):
        seen["step"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(spy_build))
    monkeypatch.setattr(LLMEngine, "step", spy_step)
    eng = AsyncEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), num_kv_blocks=64,
                                                  max_model_len=256))

    async def main():
        stream = await eng.generate("hello", SamplingParams(max_tokens=3, **GREEDY))
        outs = [o async for o in stream]
        await eng.shutdown()
        return outs

    assert asyncio.run(main())[-1].finished
    assert len(seen["build"]) == 1 and seen["build"] == seen["step"]
    assert threading.get_ident() not in seen["build"]
