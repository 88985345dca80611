"""A constrained sequence whose mask is slow sits steps out; the batch never waits for it
(structured/masks.py, the engine's `_sit_out`). Driven offline with the tiny model: a grammar
whose every mask takes 0.15 s beside an unconstrained request."""

import re
import time

from iterserve import LLM, SamplingParams
from iterserve.structured import StructuredOutputsParams
from iterserve.structured import backend

REGEX = r"[a-z]{3,12}"


def test_a_slow_mask_sits_out_instead_of_stalling_the_batch(tiny_model_dir, monkeypatch):
    """Each mask of the regex takes 0.5 s. Beside a free request, no step waits for one: the
    waits the runner makes stay far below a mask's cost (times, not step times: the machine
    may be loaded), the constrained sequence sits steps out and still gets a valid output."""
    from iterserve.structured import masks

    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256)
    real = backend.GrammarMatcher.fill_bitmask

    def slow(self, bitmask, row=0):
        if self.grammar.kind == "regex":
            time.sleep(0.5)
        return real(self, bitmask, row)

    monkeypatch.setattr(backend.GrammarMatcher, "fill_bitmask", slow)
    waits: list[tuple[float, int]] = []
    inner_wait = masks.StepMasks._wait

    def timed_wait(self):
        t0 = time.perf_counter()
        inner_wait(self)
        waits.append((time.perf_counter() - t0, self._num_scheduled))

    monkeypatch.setattr(masks.StepMasks, "_wait", timed_wait)
    con = SamplingParams(max_tokens=3, temperature=0.0,
                         structured_outputs=StructuredOutputsParams(regex=REGEX))
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["a", "b"], [con, free], use_tqdm=False)
    text = outs[0].outputs[0].text
    assert re.fullmatch(r"[a-z]{0,12}", text) and outs[0].outputs[0].finish_reason != "error"
    assert len(outs[0].outputs[0].token_ids) >= 1
    assert len(outs[1].outputs[0].token_ids) == 40
    assert llm.engine.output_processor._mask_filler.num_deferred > 0
    shared = [w for w, n in waits if n > 1]          # steps the free request was in
    assert shared and max(shared) < 0.25, sorted(shared)[-5:]
    assert not llm.engine.has_unfinished_requests()


def test_sitting_out_keeps_the_scheduler_books_and_the_output(tiny_model_dir, monkeypatch):
    """Deferred steps recompute the same token: the output equals a run where masks are
    never late, and the consistency check finds nothing."""
    def run(slow_s):
        llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256,
                  enable_prefix_caching=True, block_size=4)
        real = backend.GrammarMatcher.fill_bitmask

        def slow(self, bitmask, row=0):
            if slow_s and self.num_tokens % 2 == 1:
                time.sleep(slow_s)
            return real(self, bitmask, row)

        monkeypatch.setattr(backend.GrammarMatcher, "fill_bitmask", slow)
        con = SamplingParams(max_tokens=12, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(regex=REGEX))
        free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        outs = llm.generate(["The same prompt here", "Another prompt"], [con, free],
                            use_tqdm=False)
        assert llm.engine.check_health() == []
        deferred = llm.engine.output_processor._mask_filler.num_deferred
        monkeypatch.setattr(backend.GrammarMatcher, "fill_bitmask", real)
        return [o.outputs[0].token_ids for o in outs], deferred

    fast, _ = run(0)
    slow, deferred = run(0.06)
    assert deferred > 0
    assert slow == fast
