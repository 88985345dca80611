"""Speculative decoding's torch-free side: the config, the proposers, the adaptive plan, and
the scheduler driving a fake model that verifies drafts as the runner does."""

from __future__ import annotations

import random

import pytest

from fixtures.spec_fake import FakeVerifier, periodic_model
from iterserve.core.config import CacheConfig, ConfigError, SchedulerConfig
from iterserve.core.request import FinishReason, Request, SamplingParams
from iterserve.core.scheduler import Scheduler
from iterserve.core.spec_decode import SpeculativeConfig, SpeculativeConfigError
from iterserve.core.spec_decode.adaptive import StepShape, plan_drafts
from iterserve.core.spec_decode.ngram import NgramProposer
from iterserve.core.spec_decode.suffix import MAX_OCCURRENCES, SuffixProposer
from iterserve.core.step_time import StepTimeModel

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


# --- the config -----------------------------------------------------------------------------

def test_config_takes_vllms_keys_and_fills_its_defaults():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == \
        ("ngram", 5, 5, 5)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 4}).prompt_lookup_min == 4
    d = SpeculativeConfig.parse({"model": "draft.gguf", "num_speculative_tokens": 2})
    assert d.method == "draft_model" and d.executor_proposes
    s = SpeculativeConfig.parse({"method": "synthetic", "acceptance_rates": [0.9, 0.6, 0.3]})
    assert s.num_speculative_tokens == 3 and s.acceptance_rates == (0.9, 0.6, 0.3)
    assert SpeculativeConfig.parse(s.to_dict()) == s and SpeculativeConfig.parse({}) is None
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                    "disable_log_stats": True}).ignored == ("disable_log_stats",)


@pytest.mark.parametrize("bad, key", [
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "synthetic", "num_speculative_tokens": 2}, "acceptance_rates"),
    ({"method": "synthetic", "acceptance_rates": [0.5, 0.9]}, "acceptance_rates"),
    ({"method": "synthetic", "acceptance_rates": [0.9, 0.5], "num_speculative_tokens": 3},
     "acceptance_rates"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
])
def test_bad_configs_are_refused_naming_the_key(bad, key):
    with pytest.raises(SpeculativeConfigError) as e:
        SpeculativeConfig.parse(bad)
    assert e.value.key == key and key in str(e.value)
    with pytest.raises(ConfigError, match=f"speculative_config.{key}") as e:
        SchedulerConfig(speculative_config=bad).validate()
    assert e.value.knob == "speculative_config"


def test_the_knob_takes_json_text_as_the_flag_gives_it():
    cfg = SchedulerConfig(speculative_config='{"method": "suffix", "num_speculative_tokens": 8}')
    cfg.validate()
    assert cfg.speculative_config["method"] == "suffix"
    with pytest.raises(ConfigError, match="JSON object"):
        SchedulerConfig(speculative_config="{method: ngram}").validate()


# --- proposers -------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_longest_most_recent_match():
    p = NgramProposer(2, 3)
    r = Request("a", [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 1, 2, 3])
    # [1, 2, 3] occurred at the start (then 9, 9); [2, 3] last before 4, 5: longest wins
    assert p.propose(r, 2) == [9, 9]
    r.all_token_ids.extend([8, 2, 3])
    assert p.propose(r, 3) == [8, 2, 3]          # only [2, 3] matches now: most recent
    assert p.propose(r, 5) == [8, 2, 3, 8, 2]    # ... running into the end: it repeats
    r.all_token_ids.append(0)
    assert p.propose(r, 3) == []
    assert len(p) == 1
    p.drop("a")
    assert len(p) == 0


def test_ngram_index_grows_by_one_entry_per_size_and_token():
    p = NgramProposer(1, 2)
    r = Request("a", list(range(100)))
    p.propose(r, 4)
    idx = p._index["a"]
    assert sum(len(m) for m in idx.maps) == 99 + 98 and idx.upto == 99


def test_suffix_follows_the_most_frequent_continuation_and_stops_below_min_prob():
    p = SuffixProposer(max_depth=8, max_cached_requests=4, max_spec_factor=4.0,
                       min_token_prob=0.4)
    # "5 6" is followed by "7 8" twice and by "9" once: 7 (2/3), then 8 (2/2)
    r = Request("a", [5, 6, 7, 8, 0, 5, 6, 9, 0, 5, 6, 7, 8, 1, 5, 6])
    assert p.propose(r, 6)[:2] == [7, 8]
    p2 = SuffixProposer(8, 4, 4.0, 0.7)
    assert p2.propose(r, 6) == []                # 2/3 < 0.7: nothing sure enough


def test_suffix_uses_finished_outputs_and_its_cache_is_bounded():
    p = SuffixProposer(max_depth=16, max_cached_requests=3, max_spec_factor=2.0,
                       min_token_prob=0.1)
    done = Request("done", [1])
    done.output_token_ids.extend([40, 41, 42, 43, 44, 45])
    p.finish(done)
    r = Request("new", [7, 40, 41])
    assert p.propose(r, 8) == [42, 43, 44, 45]    # from the finished request's output
    for i in range(20):
        d = Request(f"d{i}", [1])
        d.output_token_ids.extend([100 + i, 200 + i, 300 + i, 400 + i])
        p.finish(d)
    assert p.num_cached_requests == 3
    assert p.propose(r, 8) == []                  # evicted
    assert all(len(v) <= MAX_OCCURRENCES for v in p._global.values())
    live = sum(len(v) for v in p._global.values())
    assert live <= 2 * 3 * 4, "evicted documents' entries are rebuilt away"


def test_suffix_proposes_little_after_a_short_match():
    p = SuffixProposer(max_depth=24, max_cached_requests=0, max_spec_factor=1.0,
                       min_token_prob=0.1)
    r = Request("a", [3, 4, 10, 11, 12, 13, 14, 15, 9, 4, 10])
    assert p.propose(r, 8) == [11, 12]            # matched "4 10" (2 tokens): 2 drafts


# --- the adaptive plan ------------------------------------------------------------------------

def _model():
    # 10 ms a step plus 1 ms a row: one more row is a tenth of a batch-1 step
    return StepTimeModel({"c0": 0.010, "c_seq": 0.001})


def _plan(batch, acceptance, k=6):
    base = StepShape()
    base.tokens = base.seqs = batch
    cands = []
    for r in range(batch):
        g = 1.0
        for j in range(1, k + 1):
            g *= acceptance
            cands.append((g, f"r{r}", j, 100))
    return plan_drafts(cands, base, batch, _model())[0]


def test_drafts_pay_at_batch_one_and_stop_paying_as_the_batch_grows():
    one = _plan(1, 0.8)
    assert one == {"r0": 6}                      # 0.8^6 = 0.26 > 1 * 1 / 11
    # at batch 32 G c / T = 32 * 1 / 42: a draft must be ~0.76 likely to pay
    assert _plan(32, 0.9) == {f"r{i}": 1 for i in range(32)}     # 0.9 pays, 0.81 not
    assert _plan(32, 0.75) == {}
    assert sum(_plan(1, 0.05).values()) == 0     # a request that is never right: none


def test_adaptive_speculation_turns_itself_off_for_a_request_that_is_never_right():
    """A model that never repeats itself: proposals from the prompt keep failing; after a
    few verifications the request stops verifying, but for a probe now and then."""
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=512,
                          speculative_config={**NGRAM, "prompt_lookup_min": 1})
    s = Scheduler(cfg, CacheConfig(num_kv_blocks=64, block_size=8), clock=lambda: 0.0)
    # a 20-token vocabulary in no order: 1-grams soon match, what follows rarely does
    ex = FakeVerifier(lambda toks: random.Random(len(toks)).randrange(20))
    s.add_request(Request("a", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(
        max_tokens=300, temperature=0, ignore_eos=True)))
    per_step = []
    while s.has_unfinished_requests():
        out = s.schedule()
        per_step.append(len(out.scheduled_spec_decode_tokens.get("a", ())))
        s.update_from_output(out, ex.execute(out))
    tail = per_step[60:]
    assert sum(per_step[:10]) >= 1 and sum(tail) <= len(tail) / 8


# --- the scheduler -----------------------------------------------------------------------------

def _drive(spec, *, requests=6, seed=0, blocks=200, block_size=4, abort_at=None, **kw):
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 64)
    cfg = SchedulerConfig(max_model_len=256, speculative_config=spec, **kw)
    s = Scheduler(cfg, CacheConfig(num_kv_blocks=blocks, block_size=block_size,
                                   num_swap_blocks=blocks), clock=lambda: 0.0)
    ex = FakeVerifier(periodic_model(eos=3))
    rng = random.Random(seed)
    for i in range(requests):
        s.add_request(Request(f"r{i}", [rng.randrange(50) for _ in range(rng.randrange(3, 30))],
                              SamplingParams(max_tokens=rng.randrange(5, 60), temperature=0,
                                             ignore_eos=i % 2 == 0, stop_token_ids=[17]),
                              priority=i % 3, eos_token_id=3))
    outs, steps = {}, 0
    while s.has_unfinished_requests():
        out = s.schedule()
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        res = ex.execute(out)
        for r in s.update_from_output(out, res):
            outs[r.request_id] = (list(r.output_token_ids), r.finish_reason)
        s.check_consistency()
        steps += 1
        if abort_at is not None and steps == abort_at:
            r = s.finish_request("r1", FinishReason.ABORT)
            if r is not None:
                outs["r1"] = ("aborted", None)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert len(s.spec or ()) == 0, "per-request speculation state left behind"
    return outs, steps, s


@pytest.mark.parametrize("spec", [
    NGRAM, {**NGRAM, "adaptive": False},
    {"method": "suffix", "num_speculative_tokens": 6},
    {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False}])
@pytest.mark.parametrize("kw", [
    {}, {"max_num_batched_tokens": 8},                           # chunked prefill, small budget
    {"blocks": 40, "preemption_mode": "recompute"},             # KV pressure: preemption
    {"blocks": 40, "preemption_mode": "swap"},
    {"scheduling_policy": "priority"},
])
def test_speculation_changes_the_steps_never_the_tokens(spec, kw):
    off, steps_off, _ = _drive(None, **kw)
    on, steps_on, s = _drive(spec, **kw)
    assert on == off
    total = s.spec.total
    assert total.num_drafts and total.num_accepted_tokens
    if not spec.get("adaptive", True) or not kw:
        assert steps_on < steps_off


def test_drafts_are_cut_to_the_budget_and_stop_at_eos_and_stop_tokens():
    off, _, _ = _drive(None, max_num_batched_tokens=2, requests=3)
    on, _, s = _drive({**NGRAM, "adaptive": False}, max_num_batched_tokens=2, requests=3)
    assert on == off and s.spec.total.num_drafts
    assert {reason for _, reason in on.values()} >= {FinishReason.STOP, FinishReason.LENGTH}


def test_an_abort_mid_speculation_frees_everything():
    on, _, s = _drive({**NGRAM, "adaptive": False}, abort_at=3)
    assert on["r1"][0] == "aborted"


def test_rejected_drafts_blocks_go_back_at_once_and_executors_hear_of_it():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128,
                          speculative_config={**NGRAM, "adaptive": False,
                                              "prompt_lookup_min": 1})
    s = Scheduler(cfg, CacheConfig(num_kv_blocks=32, block_size=2), clock=lambda: 0.0)
    s.add_request(Request("a", [5, 6, 7, 5, 6, 7, 5], SamplingParams(max_tokens=20,
                                                                     ignore_eos=True)))
    s.update_from_output(out := s.schedule(), {"a": 6})            # prefill, then token 6
    assert s.get_request("a").spec_token_ids == [7, 5, 6, 7]
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [7, 5, 6, 7]}
    assert out.num_scheduled_tokens == {"a": 5}
    bm = s.block_manager
    assert bm.num_device_blocks("a") == 6                           # 12 positions / 2
    s.update_from_output(out, {"a": [7, 1]})                        # one accepted, then 1
    r = s.get_request("a")
    assert r.output_token_ids == [6, 7, 1] and r.num_computed_tokens == 9
    assert bm.num_device_blocks("a") == 5                           # 9 computed: 5 blocks
    assert s.schedule().truncated_block_tables == {"a": 5}
    assert r.num_drafts == 1 and r.num_draft_tokens == 4 and r.num_accepted_tokens == 1
    assert r.trace()["spec_decode"]["acceptance_rate"] == 0.25
    s.check_consistency()


def test_drafts_never_pass_max_tokens_or_max_model_len():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=12,
                          speculative_config={**NGRAM, "adaptive": False,
                                              "prompt_lookup_min": 1})
    s = Scheduler(cfg, CacheConfig(num_kv_blocks=32, block_size=2), clock=lambda: 0.0)
    s.add_request(Request("a", [5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=100,
                                                                   ignore_eos=True)))
    ex = FakeVerifier(lambda toks: 5 if toks[-1] == 6 else 6)       # always as proposed
    while s.has_unfinished_requests():
        out = s.schedule()
        for rid, d in out.scheduled_spec_decode_tokens.items():
            r = s.get_request(rid)
            assert r.num_tokens + len(d) < cfg.max_model_len
        done = s.update_from_output(out, ex.execute(out))
    assert done[0].num_tokens == 12 and done[0].finish_reason is FinishReason.LENGTH


def test_a_stop_string_inside_a_verification_keeps_the_tokens_before_it():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                          speculative_config={**NGRAM, "adaptive": False,
                                              "prompt_lookup_min": 1})
    s = Scheduler(cfg, CacheConfig(num_kv_blocks=32, block_size=2), clock=lambda: 0.0)
    s.add_request(Request("a", [5, 6, 7, 8, 5], SamplingParams(max_tokens=20,
                                                               ignore_eos=True)))
    s.update_from_output(s.schedule(), {"a": 6})
    out = s.schedule()
    s.update_from_output(out, {"a": [7, 8, 5, 2]})
    r = s.finish_request("a", FinishReason.STOP, num_output_tokens=2)
    assert r.output_token_ids == [6, 7] and r.all_token_ids == [5, 6, 7, 8, 5, 6, 7]
    assert len(r.token_times) == 2 and s.block_manager.num_free_blocks == 32


def test_the_executor_must_return_the_accepted_drafts():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                          speculative_config={**NGRAM, "adaptive": False,
                                              "prompt_lookup_min": 1})
    s = Scheduler(cfg, CacheConfig(num_kv_blocks=32, block_size=2), clock=lambda: 0.0)
    s.add_request(Request("a", [5, 6, 7, 5], SamplingParams(max_tokens=20, ignore_eos=True)))
    s.update_from_output(s.schedule(), {"a": 6})
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens["a"][0] == 7
    with pytest.raises(ValueError, match="accepted drafts"):
        s.update_from_output(out, {"a": [9, 9]})
