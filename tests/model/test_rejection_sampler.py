"""Verification keeps the target's distribution: every emitted token, at every position, is
drawn from what the target gives that position, whatever the drafts were (a chi-square test
on a 6-token vocabulary); seeded requests draw exactly what they draw without drafts;
synthetic acceptance follows its rates."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from iterserve.core.request import SamplingParams
from iterserve.core.spec_decode.ngram import SyntheticAcceptance
from iterserve.model.rejection_sampler import DraftRow, verification_rows, verify
from iterserve.model.sampler import Sampler

V = 6
CHI2_DF5_P001 = 20.52          # chi-square critical value, 5 degrees of freedom, p = 0.001


@dataclass
class Row:
    req_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)


def target(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """What the sampler draws from: temperature, then the top-k renormalised."""
    p = torch.softmax(logits / temperature, -1)
    if top_k:
        keep = p.topk(top_k).indices
        q = torch.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    exp = probs * n
    mask = exp > 0
    assert counts[~mask].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[mask] - exp[mask]) ** 2 / exp[mask]).sum())


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 4)])
def test_every_position_is_drawn_from_the_target_whatever_the_drafts(temperature, top_k):
    torch.manual_seed(0)
    rows_logits = torch.randn(3, V) * 1.5      # positions 0, 1, 2 of one verification
    drafts = [2, 4]                            # d1 likely or not: the law must not care
    n = 6000
    sp = [SamplingParams(temperature=temperature, top_k=top_k, seed=i) for i in range(n)]
    rows = [Row(f"r{i}", sp[i]) for i in range(n)]
    logits = rows_logits.repeat(n, 1)
    res = verify(Sampler(seed=1), logits, rows, {r.req_id: drafts for r in rows})
    first = torch.zeros(V)
    second = torch.zeros(V)             # given the first draft was accepted
    third = torch.zeros(V)
    for r in res:
        toks = r.token_ids
        first[toks[0]] += 1
        if toks[0] == drafts[0]:
            assert len(toks) >= 2
            second[toks[1]] += 1
            if toks[1] == drafts[1]:
                third[toks[2]] += 1
        else:
            assert len(toks) == 1, "a token after a rejection"
    for counts, j in ((first, 0), (second, 1), (third, 2)):
        if counts.sum() >= 200:
            probs = target(rows_logits[j], temperature, top_k)
            assert chi2(counts, probs) < CHI2_DF5_P001, (j, counts, probs)
    assert second.sum() >= 200


def test_a_seeded_request_draws_what_it_draws_without_drafts():
    torch.manual_seed(1)
    steps = torch.randn(5, V)
    sp = SamplingParams(temperature=0.9, seed=1234)
    sampler = Sampler(seed=0)
    # without drafts: one position per step
    plain = []
    row = Row("a", sp)
    for j in range(5):
        t = sampler(steps[j:j + 1], [row])[0].token_id
        plain.append(t)
        row.output_token_ids.append(t)
    # with drafts: right ones are accepted, the first wrong one is replaced by the same draw
    all_right = plain[:4]
    got = verify(sampler, steps, [Row("a", sp)], {"a": all_right})[0].token_ids
    assert got == plain
    one_wrong = [plain[0], (plain[1] + 1) % V]
    got = verify(sampler, steps[:3], [Row("a", sp)], {"a": one_wrong})[0].token_ids
    assert got == plain[:2]


def test_rows_see_the_drafts_before_them_and_requests_without_drafts_keep_one_row():
    sp = SamplingParams(temperature=0.0, min_tokens=3)
    a, b = Row("a", sp, output_token_ids=[7]), Row("b", sp)
    rows = verification_rows([a, b], {"a": [1, 2]})
    assert [r.req_id for r in rows] == ["a", "a", "a", "b"]
    assert [list(r.output_token_ids) for r in rows] == [[7], [7, 1], [7, 1, 2], []]
    assert isinstance(rows[1], DraftRow) and rows[0] is a
    logits = torch.zeros(4, V)
    logits[:, 1] = logits[0, 3] = 5.0            # row 0 wants 1: draft 1 accepted ...
    logits[1, 5] = 9.0                            # ... row 1 wants 5, not draft 2
    res = verify(Sampler(), logits, [a, b], {"a": [1, 2]})
    assert res[0].token_ids == [1, 5] and res[1].token_ids == [1]
    assert res[1].verified is None


def test_synthetic_acceptance_follows_the_unconditional_rates():
    rates = [0.8, 0.5, 0.2]
    syn = SyntheticAcceptance(rates, seed=3)
    n = 20000
    counts = [0] * 4
    for _ in range(n):
        counts[syn.accepted(3)] += 1
    reached = [sum(counts[j:]) / n for j in (1, 2, 3)]    # P(draft j accepted)
    for got, want in zip(reached, rates):
        assert math.isclose(got, want, abs_tol=0.015)
    sp = SamplingParams(temperature=0.0)
    out = verify(Sampler(), torch.zeros(4, V), [Row("a", sp)], {"a": [3, 3, 3]},
                 SyntheticAcceptance([1.0, 1.0, 1.0]))
    assert out[0].token_ids == [3, 3, 3, 0]       # all forced in, then the target's argmax
