"""LLMEngine: one step = schedule -> execute -> update -> text; failures stay contained."""

from __future__ import annotations

import time

import pytest

from iterserve.core.request import SamplingParams
from iterserve.engine.args import EngineArgs
from iterserve.engine.llm_engine import LLMEngine
from iterserve.errors import (DuplicateRequestIdError, EmptyPromptError, MaxTokensTooLargeError,
                              PromptTooLongError, SamplingParamsError, TokenIdOutOfRangeError)

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 256)
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), **kw))


def run_all(engine: LLMEngine, max_steps: int = 500) -> dict:
    """Step until idle; the final RequestOutput of each request by id."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests(), "engine did not drain"
    return final


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def free_blocks(engine: LLMEngine) -> int:
    return engine.scheduler.stats().num_free_blocks


# --- the step ---------------------------------------------------------------------------

def test_greedy_request_runs_to_max_tokens_with_text_ids_and_metrics(engine):
    engine.add_request("a", "Hello world", SamplingParams(max_tokens=6, **GREEDY))
    out = run_all(engine)["a"]
    co = out.outputs[0]
    assert co.finish_reason == "length" and len(co.token_ids) == 6
    assert co.text == engine.tokenizer.decode(co.token_ids)
    m = co.metrics
    assert m.num_output_tokens == 6 and len(m.inter_token_latencies) == 5
    assert 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency
    assert out.prompt_token_ids == engine.tokenizer.encode("Hello world")


def test_each_step_emits_one_token_delta_per_running_request(engine):
    engine.add_request("s1", "one two", SamplingParams(max_tokens=4, **GREEDY))
    engine.add_request("s2", "three four five", SamplingParams(max_tokens=4, **GREEDY))
    seen = {"s1": [], "s2": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for co in out.outputs:
                assert len(co.delta_token_ids) <= 1
                seen[out.request_id] += co.delta_token_ids
                if out.finished:
                    assert seen[out.request_id] == co.token_ids
    assert all(len(v) == 4 for v in seen.values())


def test_same_greedy_output_alone_and_in_a_batch(tiny_model_dir):
    e = make_engine(tiny_model_dir)
    p = SamplingParams(max_tokens=8, **GREEDY)
    e.add_request("alone", "The quick brown fox", p)
    alone = run_all(e)["alone"].outputs[0].token_ids
    for i in range(12):
        e.add_request(f"other{i}", f"Once upon a time {i}" * (1 + i % 3), p)
    e.add_request("batched", "The quick brown fox", p)
    batched = run_all(e)["batched"].outputs[0].token_ids
    assert batched == alone


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_under_forced_preemption_equal_outputs_without(tiny_model_dir, mode):
    prompts = [f"Request number {i} says hello to the little model" for i in range(6)]
    p = SamplingParams(max_tokens=12, **GREEDY)

    def run(**kw):
        e = make_engine(tiny_model_dir, block_size=4, **kw)
        for i, prompt in enumerate(prompts):
            e.add_request(f"r{i}", prompt, p)
        final = run_all(e)
        return [final[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))], e

    roomy, e_roomy = run(num_kv_blocks=256)
    tight, e_tight = run(num_kv_blocks=12, preemption_mode=mode, num_swap_blocks=64)
    assert e_roomy.scheduler.stats().num_preemptions_total == 0
    assert e_tight.scheduler.stats().num_preemptions_total > 0, "the pool was not tight enough"
    assert tight == roomy


def test_n_sequences_fan_out_with_seed_plus_index(tiny_model_dir):
    e = make_engine(tiny_model_dir)
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)
    e.add_request("fan", "Hello", p)
    out = run_all(e)["fan"]
    assert [co.index for co in out.outputs] == [0, 1, 2]
    seqs = [co.token_ids for co in out.outputs]
    assert len({tuple(s) for s in seqs}) > 1, "n sequences should differ"
    # sequence i is exactly the single request seeded with seed + i
    e.add_request("single", "Hello", SamplingParams(max_tokens=6, temperature=1.0, seed=8,
                                                     ignore_eos=True))
    assert run_all(e)["single"].outputs[0].token_ids == seqs[1]


def test_stop_string_ends_the_request_and_is_not_returned(tiny_model_dir):
    e = make_engine(tiny_model_dir)
    e.add_request("free", "Hello world", SamplingParams(max_tokens=10, **GREEDY))
    text = run_all(e)["free"].outputs[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2)
                if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    e.add_request("stopped", "Hello world",
                  SamplingParams(max_tokens=10, stop=[stop], **GREEDY))
    co = run_all(e)["stopped"].outputs[0]
    assert co.finish_reason == "stop" and co.stop_reason == stop
    assert co.text == text[:text.index(stop)]
    assert free_blocks(e) == e.scheduler.stats().num_blocks


def test_logprobs_are_returned_when_asked(engine):
    engine.add_request("lp", "Hello", SamplingParams(max_tokens=3, logprobs=2, **GREEDY))
    co = run_all(engine)["lp"].outputs[0]
    assert [lp.token_id for lp in co.logprobs] == co.token_ids
    for lp in co.logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0][0] == lp.token_id      # greedy picks the best


# --- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, params, error", [
    ("", SamplingParams(), EmptyPromptError),
    ([], SamplingParams(), EmptyPromptError),
    ([1, 2, 10**6], SamplingParams(), TokenIdOutOfRangeError),
    ([1, -3], SamplingParams(), TokenIdOutOfRangeError),
    ([5] * 300, SamplingParams(), PromptTooLongError),
    ("Hello", SamplingParams(max_tokens=300), MaxTokensTooLargeError),
    ("Hello", SamplingParams(max_tokens=0), SamplingParamsError),
    ("Hello", SamplingParams(temperature=-1), SamplingParamsError),
    ("Hello", SamplingParams(top_p=0), SamplingParamsError),
    ("Hello", SamplingParams(n=0), SamplingParamsError),
])
def test_bad_requests_raise_precise_value_errors(engine, prompt, params, error):
    with pytest.raises(error) as info:
        engine.add_request("bad", prompt, params)
    assert isinstance(info.value, ValueError) and str(info.value)
    assert not engine.has_unfinished_requests()


def test_duplicate_live_request_id_is_refused(engine):
    engine.add_request("dup", "Hello", SamplingParams(max_tokens=2, **GREEDY))
    with pytest.raises(DuplicateRequestIdError):
        engine.add_request("dup", "Hello", SamplingParams(max_tokens=2))
    run_all(engine)


# --- abort, timeouts, failures ------------------------------------------------------------

def test_abort_frees_blocks_at_once_and_reports_abort(tiny_model_dir):
    e = make_engine(tiny_model_dir)
    total = e.scheduler.stats().num_blocks
    e.add_request("x", "Hello world", SamplingParams(max_tokens=50, **GREEDY))
    e.step()
    assert free_blocks(e) < total
    assert e.abort_request("x") is True
    assert free_blocks(e) == total
    outs = e.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "x"] == ["abort"]
    assert not e.has_unfinished_requests()
    assert e.abort_request("x") is False


def test_timeout_ends_request_with_reason_and_frees_blocks(tiny_model_dir):
    e = make_engine(tiny_model_dir, request_timeout=0.05)
    total = e.scheduler.stats().num_blocks
    e.add_request("slow", "Hello", SamplingParams(max_tokens=200, **GREEDY))
    e.step()
    time.sleep(0.08)
    out = run_all(e)["slow"].outputs[0]
    assert out.finish_reason == "timeout" and len(out.token_ids) < 200
    assert free_blocks(e) == total


class FlakyExecutor:
    """Wraps the runner; fails the whole step number `fail_on`."""

    def __init__(self, inner, fail_on: int):
        self.inner, self.fail_on, self.calls = inner, fail_on, 0

    def execute(self, output):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("simulated device failure")
        return self.inner.execute(output)


def test_executor_failure_fails_that_steps_requests_and_engine_keeps_serving(tiny_model_dir):
    e = make_engine(tiny_model_dir)
    e.executor = FlakyExecutor(e.executor, fail_on=2)
    e.add_request("victim", "Hello", SamplingParams(max_tokens=5, **GREEDY))
    final = run_all(e)
    assert final["victim"].outputs[0].finish_reason == "error"
    assert "simulated device failure" in final["victim"].error
    assert free_blocks(e) == e.scheduler.stats().num_blocks
    e.add_request("after", "Hello", SamplingParams(max_tokens=5, **GREEDY))
    assert run_all(e)["after"].outputs[0].finish_reason == "length"


def test_an_exception_in_one_request_fails_only_that_request(tiny_model_dir):
    e = make_engine(tiny_model_dir)
    real = e.output_processor.detokenizer_factory

    class Exploding:
        def __init__(self, *a, **kw):
            self.calls = 0

        def add(self, token_id):
            raise UnicodeError("cannot decode")

        def flush(self):
            return ""

    e.output_processor.detokenizer_factory = lambda tok, ids, **kw: (
        Exploding() if ids == e.tokenizer.encode("boom") else real(tok, ids, **kw))
    e.add_request("ok", "Hello", SamplingParams(max_tokens=4, **GREEDY))
    e.add_request("bad", "boom", SamplingParams(max_tokens=4, **GREEDY))
    final = run_all(e)
    assert final["bad"].outputs[0].finish_reason == "error"
    assert "cannot decode" in final["bad"].error
    assert final["ok"].outputs[0].finish_reason == "length"
    assert len(final["ok"].outputs[0].token_ids) == 4


# --- observability ------------------------------------------------------------------------

def test_trace_lists_the_lifecycle_with_steps(engine):
    engine.add_request("t", "Hello world", SamplingParams(max_tokens=3, **GREEDY))
    run_all(engine)
    trace = engine.get_trace("t")
    names = [ev["event"] for ev in trace["events"]]
    for a, b in [("arrived", "scheduled"), ("scheduled", "first_token"),
                 ("first_token", "finished")]:
        assert names.index(a) < names.index(b)
    assert "prefill_chunk" in names
    assert all(isinstance(ev["step"], int) for ev in trace["events"])
    assert trace["finish_reason"] == "length" and trace["output_tokens"] == 3
    assert trace["metrics"]["time_to_first_token"] > 0
    assert engine.get_trace("never-seen") is None


def test_stats_have_history_and_recent_requests(engine):
    engine.add_request("h", "Hello", SamplingParams(max_tokens=2, **GREEDY))
    run_all(engine)
    s = engine.stats()
    assert s["num_blocks"] == 64 and s["num_free_blocks"] == 64 and s["num_running"] == 0
    assert s["history"] and {"step", "time", "num_batched_tokens", "num_running",
                             "num_waiting", "num_swapped", "kv_cache_usage"} <= set(s["history"][-1])
    assert s["recent_requests"][0]["request_id"] == "h"


def test_finished_request_store_is_bounded(tiny_model_dir):
    e = make_engine(tiny_model_dir, max_finished_requests=3)
    for i in range(5):
        e.add_request(f"b{i}", "Hi", SamplingParams(max_tokens=1, **GREEDY))
    run_all(e)
    assert e.get_trace("b0") is None and e.get_trace("b4") is not None


def test_priority_orders_admission_under_the_priority_policy(tiny_model_dir):
    e = make_engine(tiny_model_dir, scheduling_policy="priority", max_num_seqs=1)
    e.add_request("later", "Hello", SamplingParams(max_tokens=2, **GREEDY), priority=5)
    e.add_request("urgent", "Hello", SamplingParams(max_tokens=2, **GREEDY), priority=0)
    order = [out.request_id for out in _steps(e) if out.finished]
    assert order == ["urgent", "later"]


def _steps(engine: LLMEngine):
    while engine.has_unfinished_requests():
        yield from engine.step()
