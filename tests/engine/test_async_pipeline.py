"""AsyncEngine.pipeline_steps (opt-in): the next step is submitted before a step's outputs go
to the streams (benchmarks/step_gap.py measures the gap it removes). Streams must get the
same tokens as the serial loop, every delta exactly once and in order, and a consumer that
leaves must still free its blocks, within two steps (one more than serial: the abort queues
behind the step already running)."""

from __future__ import annotations

import asyncio

import pytest

from iterserve.core.request import SamplingParams
from iterserve.engine.args import EngineArgs
from iterserve.engine.async_engine import AsyncEngine

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(tiny_model_dir, pipelined: bool) -> AsyncEngine:
    e = AsyncEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), num_kv_blocks=64,
                                                max_model_len=256))
    e.pipeline_steps = pipelined
    return e


def _streams(aengine: AsyncEngine) -> list[tuple[list[int], list[int]]]:
    async def one(i: int):
        stream = await aengine.generate(f"prompt number {i}", SamplingParams(
            max_tokens=6 + 3 * i, **GREEDY), request_id=f"r{i}")
        deltas, final = [], None
        async for out in stream:
            deltas += out.outputs[0].delta_token_ids
            final = out
        assert final.finished
        return final.outputs[0].token_ids, deltas

    async def main():
        got = await asyncio.gather(*(one(i) for i in range(5)))
        await aengine.shutdown()
        return got

    return asyncio.run(main())


def test_pipelined_loop_streams_the_same_tokens_as_the_serial_one(tiny_model_dir):
    serial = _streams(_engine(tiny_model_dir, False))
    piped = _streams(_engine(tiny_model_dir, True))
    assert piped == serial
    for i, (tokens, deltas) in enumerate(piped):
        assert len(tokens) == 6 + 3 * i and deltas == tokens     # each delta once, in order


def test_pipelined_loop_frees_a_leaving_consumers_blocks_within_two_steps(tiny_model_dir):
    aengine = _engine(tiny_model_dir, True)
    sched = aengine.engine.scheduler

    async def main():
        total = sched.stats().num_blocks
        stream = await aengine.generate("Hello world", SamplingParams(max_tokens=200, **GREEDY),
                                        request_id="leaver")
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await stream.aclose()
        at_abort = sched.step
        for _ in range(400):
            if sched.stats().num_free_blocks == total:
                break
            await asyncio.sleep(0.005)
        freed_by = sched.step
        trace = await aengine.get_trace("leaver")
        await aengine.shutdown()
        return total, freed_by - at_abort, trace

    total, steps, trace = asyncio.run(main())
    assert sched.stats().num_free_blocks == total
    assert steps <= 2 and trace["finish_reason"] == "abort"
