"""prompt_logprobs (vLLM's SamplingParams.prompt_logprobs = k), offline: compared with HF
transformers' logits of the same tiny model, with chunked prefill forced small, the prefix
cache on (a request asking for them must not skip cached rows), n > 1 and preemption."""

from __future__ import annotations

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.errors import SamplingParamsError

PROMPT = "The quick brown fox jumps over the lazy dog again and again and again"


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from fixtures.tiny_models import load_hf_reference
    return load_hf_reference(tiny_model_dir)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_against_hf(out, hf, k: int) -> None:
    ids = out.prompt_token_ids
    plps = out.prompt_logprobs
    assert plps is not None and len(plps) == len(ids) and plps[0] is None
    ref = hf_logprobs(hf, ids)
    for p in range(1, len(ids)):
        row, entry = ref[p - 1], plps[p]
        actual = entry[ids[p]]
        assert actual.logprob == pytest.approx(row[ids[p]].item(), abs=1e-4)
        assert actual.rank == int((row > row[ids[p]]).sum()) + 1
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == set(top) | {ids[p]}
        for r, t in enumerate(top, 1):
            assert entry[t].rank == r
            assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
            assert entry[t].decoded_token == out_tok(t)


_TOK = None


def out_tok(t):
    return _TOK.decode([t], skip_special_tokens=False)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    global _TOK
    # A 6-token budget: every prompt prefills in several chunks.
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, block_size=4,
              max_num_batched_tokens=6, enable_prefix_caching=True)
    _TOK = llm.get_tokenizer()
    return llm


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_hf_across_small_chunks(llm, hf, k):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=k),
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 12            # at least 3 chunks of 6
    check_against_hf(out, hf, k)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(llm, hf):
    plain = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(PROMPT + " warm", plain, use_tqdm=False)
    again = llm.generate(PROMPT + " warm", plain, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None
    out = llm.generate(PROMPT + " warm", SamplingParams(max_tokens=1, temperature=0,
                                                        prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check_against_hf(out, hf, 2)


def test_batched_with_other_requests_and_n_greater_than_one(llm, hf):
    params = [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1),
              SamplingParams(max_tokens=3, temperature=0.8, seed=1, n=3, prompt_logprobs=2),
              SamplingParams(max_tokens=3, temperature=0)]
    prompts = [PROMPT, "Another prompt of a different length, here", "no logprobs"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    check_against_hf(outs[0], hf, 1)
    check_against_hf(outs[1], hf, 2)
    assert len(outs[1].outputs) == 3
    assert outs[2].prompt_logprobs is None


def test_a_one_token_prompt_has_just_none(llm):
    out = llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=1,
                                                                 prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_preempted_requests_keep_correct_prompt_logprobs(tiny_model_dir, hf):
    global _TOK
    for mode in ("recompute", "swap"):
        llm = LLM(str(tiny_model_dir), num_kv_blocks=14, max_model_len=128, block_size=4,
                  max_num_batched_tokens=8, preemption_mode=mode, num_swap_blocks=64)
        _TOK = llm.get_tokenizer()
        prompts = [PROMPT, PROMPT + " two", PROMPT + " three"]
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0,
                                                    ignore_eos=True, prompt_logprobs=1),
                            use_tqdm=False)
        assert llm.engine.scheduler.stats().num_preemptions_total > 0, mode
        for o in outs:
            check_against_hf(o, hf, 1)


def test_negative_prompt_logprobs_is_refused():
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate()
