"""`draft_model` speculation through the offline API (model/draft.py): a draft model with the
target's vocabulary proposes each verification's drafts, and the tokens are speculation
off's whatever the draft proposes, through preemption (recompute and swap) and seeded
sampling, with every block returned."""

from __future__ import annotations

import pytest

from iterserve import LLM, SamplingParams
from iterserve.errors import ConfigError

KW = dict(max_model_len=256, block_size=4)
PROMPTS = ["the cat sat on the mat. the cat sat", "hello world, this is", "a b c d e f g",
           "one two three four"]


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """A second tiny random model with the same tokenizer: its drafts are rarely the
    target's tokens."""
    from fixtures.tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("draft-tiny-llama"), seed=7)


def draft_llm(target, draft, k=4, **kw):
    spec = {"model": str(draft), "num_speculative_tokens": k, "adaptive": False}
    return LLM(str(target), speculative_config=spec, **{**KW, "num_kv_blocks": 96, **kw})


def tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def check_books(llm):
    st = llm.engine.scheduler.stats()
    assert st.num_free_blocks == st.num_blocks, "a block leaked"
    # Finished requests reach the executor with the next step's data, so the draft holds
    # what the runner still holds, never more.
    ex = llm.engine.executor
    assert set(ex.draft.valid) <= set(ex.requests), "the draft kept an ended request"


@pytest.fixture(scope="module")
def off(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_kv_blocks=96, **KW)


def test_the_target_as_its_own_draft_accepts_everything(tiny_model_dir, off):
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    on = draft_llm(tiny_model_dir, tiny_model_dir)
    assert tokens(on.generate(PROMPTS, sp, use_tqdm=False)) == \
        tokens(off.generate(PROMPTS, sp, use_tqdm=False))
    total = on.engine.scheduler.stats().spec_decoding_total
    assert total.num_draft_tokens > 100
    assert total.num_accepted_tokens >= 0.95 * total.num_draft_tokens
    # Fewer target steps than tokens: 4 drafts and the target's own a step, mostly.
    assert on.engine.executor.draft.forward_passes > 0
    check_books(on)


def test_another_models_drafts_change_nothing_but_the_acceptance(tiny_model_dir,
                                                                 other_model_dir, off):
    on = draft_llm(tiny_model_dir, other_model_dir)
    for sp in (SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
               SamplingParams(max_tokens=32, temperature=0.9, seed=5, ignore_eos=True)):
        assert tokens(on.generate(PROMPTS, sp, use_tqdm=False)) == \
            tokens(off.generate(PROMPTS, sp, use_tqdm=False))
    total = on.engine.scheduler.stats().spec_decoding_total
    assert total.num_draft_tokens > 0 and total.num_accepted_tokens < total.num_draft_tokens
    check_books(on)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_start_their_draft_over_and_keep_their_tokens(tiny_model_dir,
                                                                         mode):
    # 40 blocks of 4 tokens for 4 requests of up to ~70 tokens: they preempt each other.
    small = dict(num_kv_blocks=40, preemption_mode=mode, max_num_seqs=4)
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ref = LLM(str(tiny_model_dir), **KW, **small)
    on = draft_llm(tiny_model_dir, tiny_model_dir, **small)
    want = tokens(ref.generate(PROMPTS, sp, use_tqdm=False))
    assert tokens(on.generate(PROMPTS, sp, use_tqdm=False)) == want
    assert on.engine.scheduler.stats().num_preemptions_total > 0
    total = on.engine.scheduler.stats().spec_decoding_total
    assert total.num_accepted_tokens >= 0.9 * total.num_draft_tokens
    check_books(on)


def test_a_draft_with_another_vocabulary_is_refused_at_start(tiny_model_dir, tmp_path):
    from fixtures.tiny_models import make_tiny_model_dir

    other = make_tiny_model_dir(tmp_path / "v", vocab_size=600)
    with pytest.raises(ConfigError) as e:
        draft_llm(tiny_model_dir, other)
    assert "vocabulary" in str(e.value) and e.value.knob == "speculative_config"


def test_a_constrained_sequence_keeps_its_grammar_and_its_tokens(tiny_model_dir, off):
    """The grammar cannot check a draft the draft model has not made yet, so a constrained
    sequence verifies none; its tokens and the grammar's match are speculation off's."""
    import re

    from iterserve.structured import StructuredOutputsParams

    regex = r"(cat|mat|sat|on|the)( (cat|mat|sat|on|the)){6,12}\."
    sp = SamplingParams(max_tokens=60, temperature=0.0,
                        structured_outputs=StructuredOutputsParams(regex=regex))
    on = draft_llm(tiny_model_dir, tiny_model_dir)
    a = off.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0]
    b = on.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0]
    assert b.token_ids == a.token_ids and re.fullmatch(regex, b.text), b.text
    check_books(on)
