"""The sampler's answer for a row does not depend on the other rows of the batch (issue 28):
the token, its logprob and the top logprobs (values and order) of a row sampled alone equal
those it gets anywhere inside a batch of rows with other parameters, for greedy rows (ties
included), seeded and unseeded random rows, top-k / top-p / min-p, penalties and logprobs."""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.core.request import Request, SamplingParams
from iterserve.model.sampler import Sampler

V = 300


class Row:
    """A runner-like row: a request id, params, prompt and output tokens."""

    def __init__(self, req_id, params, prompt, output):
        self.req_id, self.sampling_params = req_id, params
        self.prompt_token_ids, self.output_token_ids = prompt, output


params = st.builds(
    lambda temp, top_k, top_p, min_p, seed, lp, rep, pres, freq: SamplingParams(
        temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, logprobs=lp,
        repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq),
    st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.3]),
    st.sampled_from([0, 0, 1, 5, 40]),
    st.sampled_from([1.0, 1.0, 0.9, 0.5]),
    st.sampled_from([0.0, 0.0, 0.1]),
    st.one_of(st.none(), st.integers(0, 1000)),
    st.one_of(st.none(), st.integers(0, 20)),
    st.sampled_from([1.0, 1.0, 1.2]),
    st.sampled_from([0.0, 0.0, 0.5]),
    st.sampled_from([0.0, 0.0, 0.3]))


def _logits(rng: random.Random, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    row = torch.randn(V, generator=g) * rng.choice([0.5, 3.0])
    if ties:      # several exact maxima and repeated values, as a masked or flat row has
        row[torch.randperm(V, generator=g)[:5]] = row.max() + 1
        row[torch.randperm(V, generator=g)[:40]] = row.min()
    return row


def _result(r):
    return (r.token_id, r.logprob, tuple(r.top_logprobs or ()))


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(params, min_size=1, max_size=9), st.integers(0, 2 ** 16), st.data())
def test_a_rows_sample_does_not_depend_on_the_batch(plist, seed, data):
    rng = random.Random(seed)
    rows, logits = [], []
    for i, p in enumerate(plist):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 6))]
        output = [rng.randrange(V) for _ in range(rng.randint(0, 6))]
        rows.append(Row(f"req-{seed}-{i}", p, prompt, output))
        logits.append(_logits(rng, data.draw(st.booleans(), label="ties")))
    batch = torch.stack(logits)
    sampler = Sampler(seed=7)
    together = [_result(r) for r in sampler(batch.clone(), rows)]
    order = data.draw(st.permutations(range(len(rows))), label="order")
    shuffled = sampler(batch[list(order)].clone(), [rows[i] for i in order])
    for i, r in enumerate(rows):
        alone = _result(Sampler(seed=7)(batch[i:i + 1].clone(), [r])[0])
        assert together[i] == alone, f"row {i} ({r.sampling_params}) changed in the batch"
        assert _result(shuffled[order.index(i)]) == alone


def test_unseeded_rows_draw_from_their_own_stream_and_greedy_ties_go_to_the_lowest_id():
    logits = torch.zeros(1, V)
    logits[0, [7, 3, 250]] = 5.0
    row = Row("g", SamplingParams(temperature=0.0, logprobs=3), [1], [])
    res = Sampler()(logits, [row])[0]
    assert res.token_id == 3
    assert [t for t, _ in res.top_logprobs] == [3, 7, 250]     # equal values by token id
    # an unseeded row's token follows its request id and output count, not the batch
    flat = torch.zeros(1, V)
    a = Row("abc", SamplingParams(temperature=1.0), [1], [2, 3])
    s = Sampler(seed=1)
    alone = s(flat, [a])[0].token_id
    assert s(flat.expand(4, V).contiguous(),
             [Row(f"x{i}", SamplingParams(temperature=1.0), [1], []) for i in range(3)] + [a]
             )[3].token_id == alone
    draws = {Sampler(seed=1)(flat, [Row(f"r{i}", SamplingParams(temperature=1.0), [1], [])])[0]
             .token_id for i in range(50)}
    assert len(draws) > 30                                    # different ids, different draws
    # a core Request (request_id) is a row with an id too
    req = Request("abc", [1], SamplingParams(temperature=1.0))
    for t in (2, 3):
        req.append_output_token(t, 0.0)
    assert Sampler(seed=1)(flat, [req])[0].token_id == alone


def test_tied_top_logprobs_at_the_boundary_are_the_lowest_ids_whatever_the_batch_asks():
    row = torch.zeros(V)
    row[10] = 2.0                                             # one best, then 299 ties
    a = Row("a", SamplingParams(temperature=0.0, logprobs=3), [1], [])
    b = Row("b", SamplingParams(temperature=0.0, logprobs=20), [1], [])
    alone = Sampler()(row[None].clone(), [a])[0].top_logprobs
    both = Sampler()(torch.stack([row, row]), [a, b])[0].top_logprobs
    assert [t for t, _ in alone] == [10, 0, 1] == [t for t, _ in both]
