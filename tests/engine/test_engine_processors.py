"""LLMEngine's parts on a real Scheduler with a fake executor and tokenizer (no model, no torch
work): n > 1 fan-out cost, outputs listing what changed, check_health, scheduler_stats."""

from __future__ import annotations

import logging

import pytest

from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.request import SamplingParams
from iterserve.core.scheduler import Scheduler, SchedulerStats
from iterserve.core.scheduler_output import SampleResult
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.metrics import RequestMetrics
from iterserve.errors import SamplingParamsError
from iterserve.model.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """One character per token id: 'a' + id % 26."""

    def encode(self, text, add_special_tokens=True):
        return [1 + ord(c) % 50 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class ConstantExecutor:
    """Samples token 7 for every request whose scheduled tokens reach its last token (read
    from the scheduler's own Requests, which update_from_output has not advanced yet)."""

    def __init__(self, scheduler):
        self.scheduler, self.steps = scheduler, 0

    def execute(self, out):
        self.steps += 1
        reqs = self.scheduler.requests
        return {rid: SampleResult(7) for rid, n in out.num_scheduled_tokens.items()
                if reqs[rid].num_computed_tokens + n >= reqs[rid].num_tokens}


def make_engine(scheduler_cls=Scheduler, max_num_seqs=32, num_blocks=4096) -> LLMEngine:
    sched = scheduler_cls(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                        max_model_len=256),
        CacheConfig(block_size=16, num_kv_blocks=num_blocks))
    return LLMEngine(sched, ConstantExecutor(sched), CharTokenizer(), max_model_len=256,
                     vocab_size=100, detokenizer_factory=IncrementalDetokenizer)


def drain(engine: LLMEngine, max_steps: int = 10_000) -> list:
    outs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        outs.extend(engine.step())
    raise AssertionError("engine did not drain")


# --- n > 1 fan-out is linear in n -------------------------------------------------------------

def fan_out_cost(n: int, monkeypatch) -> tuple[float, float, int]:
    """(completion outputs emitted per sequence, metrics computed per sequence, steps)."""
    calls = {"metrics": 0}
    real = RequestMetrics.from_request.__func__

    def counting(cls, req, now=None):
        calls["metrics"] += 1
        return real(cls, req, now)

    monkeypatch.setattr(RequestMetrics, "from_request", classmethod(counting))
    e = make_engine(max_num_seqs=32)
    e.add_request("fan", "hello", SamplingParams(n=n, max_tokens=1, ignore_eos=True))
    outs = drain(e)
    final = outs[-1]
    assert final.finished and [co.index for co in final.outputs] == list(range(n))
    assert all(co.finish_reason == "length" and co.token_ids == [7] for co in final.outputs)
    emitted = sum(len(o.outputs) for o in outs)
    return emitted / n, calls["metrics"] / n, e.executor.steps


def test_fan_out_output_cost_per_sequence_does_not_grow_with_n(monkeypatch):
    # With max_num_seqs 32 the n sequences take n / 32 steps. Before, every step rebuilt all
    # n sequences' outputs and metrics: ~n/32 outputs and metrics per sequence (12.5 at
    # n=400, 1.6 at n=50). Now each sequence is emitted when it changes, plus once in the
    # final output; metrics once at the finish and twice in the retired trace.
    small = fan_out_cost(50, monkeypatch)
    large = fan_out_cost(400, monkeypatch)
    assert large[2] >= 13 > small[2]                  # the large one really spans many steps
    for emitted, metrics, _ in (large, small):
        assert emitted <= 2.0 and metrics <= 3.0


def test_intermediate_outputs_list_only_the_sequences_that_changed():
    e = make_engine(max_num_seqs=2)
    e.add_request("r", "hi", SamplingParams(n=5, max_tokens=2, ignore_eos=True))
    outs = drain(e)
    for out in outs[:-1]:
        assert not out.finished and out.metrics is None
        assert 1 <= len(out.outputs) <= 2                   # at most max_num_seqs ran
        assert all(co.delta_token_ids == [7] for co in out.outputs)
    final = outs[-1]
    assert [co.index for co in final.outputs] == [0, 1, 2, 3, 4]
    assert final.metrics.num_output_tokens == 10
    # Every sequence's finish is reported exactly once, and the deltas add up to the tokens.
    assert sum(co.finished_in_this_step for o in outs for co in o.outputs) == 5
    for i in range(5):
        deltas = [t for o in outs for co in o.outputs if co.index == i for t in co.delta_token_ids]
        assert deltas == [7, 7]


# --- check_health -------------------------------------------------------------------------

class BrokenScheduler(Scheduler):
    """A real scheduler whose consistency check reports what the test plants."""

    violations: list = []

    def consistency_violations(self):
        return list(self.violations)


def test_check_health_ends_the_named_requests_with_error_and_frees_their_blocks(caplog):
    e = make_engine(BrokenScheduler)
    total = e.scheduler_stats().num_blocks
    e.add_request("bad", "hello there", SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    e.add_request("good", "hello", SamplingParams(max_tokens=3, ignore_eos=True))
    e.step()
    assert e.check_health() == []
    BrokenScheduler.violations = [("bad-n1", "holds blocks twice"), (None, "free list short")]
    try:
        with caplog.at_level(logging.ERROR, logger="iterserve.engine.llm_engine"):
            msgs = e.check_health()
    finally:
        BrokenScheduler.violations = []
    assert msgs == ["request bad-n1: holds blocks twice", "free list short"]
    assert "bad-n1" in caplog.text and "free list short" in caplog.text
    assert e.scheduler.get_request("bad-n1") is None          # ended in the scheduler
    outs = {o.request_id: o for o in e.step()}
    bad = outs["bad"]
    assert [co.finish_reason for co in bad.outputs if co.index == 1] == ["error"]
    assert "holds blocks twice" in bad.error
    e.abort_request("bad")
    final = {o.request_id: o for o in drain(e)}
    assert final["good"].outputs[0].finish_reason == "length"
    assert e.scheduler_stats().num_free_blocks == total


def test_a_consistency_check_that_raises_is_reported_and_ends_nothing():
    class CrashingCheck(Scheduler):
        def consistency_violations(self):
            raise KeyError("tables")

    e = make_engine(CrashingCheck)
    e.add_request("x", "hello", SamplingParams(max_tokens=3, ignore_eos=True))
    e.step()
    msgs = e.check_health()
    assert len(msgs) == 1 and "KeyError" in msgs[0]
    assert [o.outputs[0].finish_reason for o in drain(e) if o.finished] == ["length"]


def test_a_healthy_engine_reports_no_violations_at_any_step():
    e = make_engine(max_num_seqs=3, num_blocks=8)       # tight: requests wait and preempt
    for i in range(6):
        e.add_request(f"r{i}", "hello world " * (1 + i % 3),
                      SamplingParams(n=1 + i % 2, max_tokens=12, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
        assert e.check_health() == []
    assert e.check_health() == []


def test_scheduler_stats_is_the_scheduler_snapshot():
    e = make_engine()
    e.add_request("x", "hello", SamplingParams(max_tokens=4, ignore_eos=True))
    e.step()
    s = e.scheduler_stats()
    assert isinstance(s, SchedulerStats) and s.num_running == 1 and s.num_free_blocks < s.num_blocks


# --- num_cached_tokens, prompt_logprobs -----------------------------------------------------

def test_num_cached_tokens_counts_prefix_cache_hits():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096,
                                      max_model_len=256),
                      CacheConfig(block_size=4, num_kv_blocks=256, enable_prefix_caching=True))
    e = LLMEngine(sched, ConstantExecutor(sched), CharTokenizer(), max_model_len=256, vocab_size=100)
    prompt = "a long shared prompt of many tokens"
    e.add_request("first", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    first = [o for o in drain(e) if o.finished][0]
    e.add_request("second", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    second = [o for o in drain(e) if o.finished][0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 4 * ((len(prompt) - 1) // 4) - 4 > 0
    assert second.prompt_logprobs is None


def test_prompt_logprobs_skip_the_prefix_cache_and_bad_values_are_refused():
    """A request asking for prompt_logprobs needs logits at every prompt row, so it gets no
    cached blocks (vLLM's rule); a negative k is a 400 naming the field."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096,
                                      max_model_len=256),
                      CacheConfig(block_size=4, num_kv_blocks=256, enable_prefix_caching=True))
    e = LLMEngine(sched, ConstantExecutor(sched), CharTokenizer(), max_model_len=256, vocab_size=100)
    prompt = "a long shared prompt of many tokens"
    e.add_request("first", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    drain(e)
    e.add_request("second", prompt, SamplingParams(max_tokens=2, ignore_eos=True,
                                                   prompt_logprobs=1))
    second = [o for o in drain(e) if o.finished][0]
    assert second.num_cached_tokens == 0
    with pytest.raises(SamplingParamsError, match="prompt_logprobs") as info:
        e.add_request("p", "hello", SamplingParams(prompt_logprobs=-2))
    assert info.value.param == "prompt_logprobs"
    assert not e.has_unfinished_requests()


# --- the processors on their own ------------------------------------------------------------

def test_input_processor_fans_out_with_seed_plus_index_and_every_eos_as_a_stop():
    from iterserve.engine.input_processor import InputProcessor

    ip = InputProcessor(CharTokenizer(), vocab_size=100, max_model_len=64,
                        eos_token_ids=[9, 3, 5], clock=lambda: 1.0)
    req = ip.process("r", "hey", SamplingParams(n=3, seed=10, stop_token_ids=[5], max_tokens=4),
                     timeout=2.0)
    assert [r.request_id for r in req.requests] == ["r-n0", "r-n1", "r-n2"]
    assert [r.sampling_params.seed for r in req.requests] == [10, 11, 12]
    for r in req.requests:
        assert r.sampling_params.n == 1 and r.eos_token_id == 3
        assert r.sampling_params.stop_token_ids == [5, 9] and r.deadline == 3.0
        assert r.user_data == "r" and r.prompt_token_ids == req.prompt_token_ids
    single = ip.process("s", [4, 5], SamplingParams())
    assert [r.request_id for r in single.requests] == ["s"] and single.prompt is None


def test_output_processor_turns_tokens_into_text_and_reports_stop_strings_to_end():
    from iterserve.core.request import FinishReason
    from iterserve.engine.input_processor import InputProcessor
    from iterserve.engine.metrics import StepStats
    from iterserve.engine.output_processor import OutputProcessor

    ip = InputProcessor(CharTokenizer(), vocab_size=100, max_model_len=64)
    op = OutputProcessor(CharTokenizer(), clock=lambda: 1.0,
                         detokenizer_factory=IncrementalDetokenizer)
    op.add_request(ip.process("r", "ab", SamplingParams(n=2, stop=["dd"], max_tokens=8)))
    stats = StepStats(step=0, time=0.0)
    ended = []
    for token in (2, 3, 3):                       # "c", "d", "d": the stop string on the 3rd
        sampled = op.live_tokens({"r-n0": SampleResult(token), "r-n1": SampleResult(2)})
        for sid in sampled:                        # the scheduler's part: append the token
            state, seq = op._seqs[sid]
            seq.request.output_token_ids.append(sampled[sid])
        ended += op.process_tokens(sampled, {s: SampleResult(t) for s, t in sampled.items()},
                                   stats)
    assert ended == [("r-n0", FinishReason.STOP)]
    outs, retired = op.make_outputs(stats)
    assert retired == [] and len(outs) == 1
    seq0, seq1 = outs[0].outputs
    assert (seq0.text, seq0.finish_reason, seq0.stop_reason) == ("c", "stop", "dd")
    assert seq0.finished_in_this_step and seq1.finish_reason is None
    assert op.live_tokens({"r-n0": SampleResult(1)}) == {}     # a stopped sequence takes no more
    assert op.abort("r") == ["r-n1"]
    outs, retired = op.make_outputs(stats)
    assert outs[0].finished and [s.request_id for s in retired] == ["r"]
    assert not op.has_request("r") and op.abort("r") is None
