"""The sampler: greedy, seeded repeatability, support restriction, penalties, logprobs."""

import math

import pytest
import torch

from iterserve.core.request import Request, SamplingParams
from iterserve.model.sampler import Sampler, apply_penalties

V = 64


def req(rid="r", prompt=(1, 2, 3), output=(), **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params))
    for t in output:
        r.append_output_token(t, 0.0)
    return r


def random_logits(n, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, vocab), generator=g) * 3


def test_greedy_is_argmax():
    logits = random_logits(5)
    out = Sampler()(logits, [req(str(i), temperature=0.0) for i in range(5)])
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = random_logits(4, seed=1)
    reqs = [req("a", temperature=0.0), req("b", temperature=1.0),
            req("c", temperature=0.0, logprobs=2), req("d", temperature=0.7, top_k=5)]
    out = Sampler(seed=0)(logits, reqs)
    assert out[0].token_id == int(logits[0].argmax())
    assert out[2].token_id == int(logits[2].argmax())


def test_seeded_results_repeat_across_sampler_instances():
    logits = random_logits(1, seed=2)
    a = [Sampler()(logits, [req(seed=123, output=[5] * n)])[0].token_id for n in range(20)]
    b = [Sampler()(logits, [req(seed=123, output=[5] * n)])[0].token_id for n in range(20)]
    assert a == b
    assert len(set(a)) > 1, "the step index must change the draw"


def test_seeded_result_is_independent_of_batch_composition_and_row():
    logits = random_logits(6, seed=3)
    target = logits[2].clone()
    alone = [Sampler()(target.unsqueeze(0), [req("t", seed=7, output=[9] * n, top_p=0.9)])[0]
             .token_id for n in range(10)]
    for perm_seed in range(3):
        others = [req(f"o{i}", temperature=0.8 + 0.1 * i, top_k=i + 3) for i in range(5)]
        rows = list(range(6))
        perm = torch.randperm(6, generator=torch.Generator().manual_seed(perm_seed)).tolist()
        for n in range(10):
            batch = [None] * 6
            batch_logits = torch.empty_like(logits)
            t = req("t", seed=7, output=[9] * n, top_p=0.9)
            members = [t] + others
            sources = [target] + [logits[i] for i in rows if i != 2]
            for dst, (r, row) in zip(perm, zip(members, sources)):
                batch[dst] = r
                batch_logits[dst] = row
            out = Sampler()(batch_logits, batch)
            assert out[perm[0]].token_id == alone[n]


def test_different_seeds_give_different_streams():
    logits = torch.zeros((1, V))   # uniform: every token equally likely
    a = [Sampler()(logits, [req(seed=1, output=[0] * n)])[0].token_id for n in range(30)]
    b = [Sampler()(logits, [req(seed=2, output=[0] * n)])[0].token_id for n in range(30)]
    assert a != b


def _support(n_draws, **params):
    logits = random_logits(1, seed=4).expand(n_draws, V).contiguous()
    sampler = Sampler(seed=0)
    out = sampler(logits, [req(str(i), **params) for i in range(n_draws)])
    return {r.token_id for r in out}, logits[0]


def test_top_k_restricts_support_to_the_k_best():
    support, row = _support(2000, top_k=4)
    assert support == set(row.topk(4).indices.tolist())


def test_top_p_restricts_support_to_the_smallest_nucleus():
    support, row = _support(3000, top_p=0.6)
    probs, order = row.softmax(-1).sort(descending=True)
    nucleus_size = int((probs.cumsum(-1) < 0.6).sum()) + 1
    assert support == set(order[:nucleus_size].tolist())


def test_a_top_p_that_is_zero_in_float32_keeps_the_best_token():
    # 5e-324 is a valid JSON float > 0 that float32 rounds to 0: the nucleus is the best
    # token, never empty (an empty one sampled an arbitrary, possibly masked-out, token).
    support, row = _support(200, top_p=5e-324)
    assert support == {int(row.argmax())}


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    support, row = _support(3000, min_p=0.2)
    probs = row.softmax(-1)
    assert support == set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())


def test_unrestricted_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(6000, 3).contiguous()
    out = Sampler(seed=0)(logits, [req(str(i)) for i in range(6000)])
    freq = torch.bincount(torch.tensor([r.token_id for r in out]), minlength=3) / 6000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_temperature_sharpens_the_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.4]])).expand(4000, 2).contiguous()
    out = Sampler(seed=0)(logits, [req(str(i), temperature=0.25) for i in range(4000)])
    share0 = sum(r.token_id == 0 for r in out) / 4000
    expected = 0.6 ** 4 / (0.6 ** 4 + 0.4 ** 4)   # p^(1/T) renormalised
    assert abs(share0 - expected) < 0.03


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    r = req(prompt=[0], output=[1], repetition_penalty=2.0)
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]


def test_frequency_and_presence_penalties_use_output_counts_only():
    logits = torch.zeros((1, 5))
    r = req(prompt=[4, 4], output=[1, 1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[0.0, -1.75, -0.75, 0.0, 0.0]]


def test_penalties_apply_per_row():
    logits = torch.ones((2, 4))
    a = req("a", prompt=[0], output=[1], frequency_penalty=1.0)
    b = req("b", prompt=[0], output=[1])
    out = apply_penalties(logits, [a, b])
    assert out[0].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert out[1].tolist() == [1.0, 1.0, 1.0, 1.0]


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    out = Sampler()(logits, [req(output=[0], temperature=0.0, presence_penalty=1.0)])
    assert out[0].token_id == 1


def test_logprobs_are_raw_log_softmax_and_top_logprobs_sorted():
    logits = random_logits(3, seed=5)
    reqs = [req("a", temperature=0.0, logprobs=5), req("b", seed=3, logprobs=0, top_k=3),
            req("c")]
    out = Sampler()(logits, reqs)
    ref = torch.log_softmax(logits, -1)
    for i in (0, 1):
        assert math.isclose(out[i].logprob, float(ref[i, out[i].token_id]), abs_tol=1e-5)
    top = out[0].top_logprobs
    assert [t for t, _ in top] == ref[0].topk(5).indices.tolist()
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert out[1].top_logprobs == []
    assert out[2].logprob is None and out[2].top_logprobs is None


def test_bad_logits_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="num_requests=2"):
        Sampler()(torch.zeros((3, V)), [req("a"), req("b")])


def test_top_p_nucleus_wider_than_the_prefilter_head_is_exact():
    from iterserve.model import sampler as sampler_mod
    vocab = 2 * sampler_mod.PREFILTER
    logits = (-torch.arange(vocab, dtype=torch.float32) * 1e-4).expand(4000, vocab).contiguous()
    probs = logits[0].softmax(-1)
    nucleus = int((probs.cumsum(-1) - probs < 0.75).sum())
    assert nucleus > sampler_mod.PREFILTER
    out = Sampler(seed=0)(logits, [req(str(i), top_p=0.75) for i in range(4000)])
    ids = [r.token_id for r in out]
    assert max(ids) < nucleus
    assert max(ids) >= sampler_mod.PREFILTER, "draws must reach past the prefiltered head"


def test_top_k_and_top_p_combine_top_k_first():
    # after top-k=3 renormalises [0.5, 0.3, 0.2] the nucleus for p=0.7 is the best two tokens
    probs = torch.tensor([[0.4, 0.24, 0.16, 0.1, 0.1]])
    logits = probs.log().expand(2000, 5).contiguous()
    out = Sampler(seed=0)(logits, [req(str(i), top_k=3, top_p=0.7) for i in range(2000)])
    assert {r.token_id for r in out} == {0, 1}


def test_rows_that_fit_the_prefilter_and_rows_that_do_not_mix_in_one_batch():
    from iterserve.model import sampler as sampler_mod
    vocab = 2 * sampler_mod.PREFILTER
    flat = -torch.arange(vocab, dtype=torch.float32) * 1e-4       # nucleus of 0.75: ~1,500 ids
    peaked = flat.clone()
    peaked[7] = 30.0                                               # nucleus: just id 7
    logits = torch.stack([flat, peaked] * 1000)
    reqs = [req(str(i), top_p=0.75, seed=i) for i in range(2000)]
    out = [r.token_id for r in Sampler()(logits, reqs)]
    assert set(out[1::2]) == {7}
    assert max(out[0::2]) >= sampler_mod.PREFILTER
    # and a seeded row gives the same token alone as in the mixed batch
    assert Sampler()(flat.unsqueeze(0), [req("0", top_p=0.75, seed=0)])[0].token_id == out[0]


def test_row_argmax_equals_torch_argmax_with_ties_nan_and_strides():
    """The sampler's greedy argmax (numpy on CPU, see row_argmax) picks what torch.argmax
    picks: the first maximum, NaN as the maximum, any row stride."""
    from iterserve.model.sampler import row_argmax
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g)
    x[1, 10] = x[1, 20] = 50.0           # a tie: the first one
    x[2, 7] = float("nan")
    x[3] = 0.0                           # all equal: index 0
    for t in (x, x[:, ::3], x[::2], x.t().contiguous().t()):
        with torch.inference_mode():
            got = row_argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1))
    assert torch.equal(row_argmax(x.double()), x.double().argmax(dim=-1))   # torch fallback
