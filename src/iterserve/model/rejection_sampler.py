"""Verifying a step's drafts: sample at every verified position, keep the agreeing prefix.

A request that verifies k drafts d_1..d_k has k + 1 logits rows: row j is the target's
distribution after its tokens plus d_1..d_j. Row j is sampled exactly as a step without
drafts would sample that position: the same Sampler call (penalties, logits processors,
temperature, top-k/top-p/min-p, the grammar mask of that position), through a `DraftRow`
that shows the sampler the request as it would be with d_1..d_j accepted (its outputs, hence
its seed's draw index and min_tokens count). Drafts are accepted while d_j equals row j-1's
sample; the first sample that differs, or the one after the last draft, is the step's own
token. So the tokens are those speculation off would produce: with greedy rows whenever the
verified rows' logits equal a decode step's (the runner computes them as decode rows), and
with a seeded request's draws too (its uniform at position p is the same either way).

This is rejection sampling with point-mass drafts (vLLM's rejection sampler without draft
probabilities, as for n-gram proposals): accepting d with probability p(d), and otherwise
drawing from p with d removed and renormalised, is the same law as drawing x ~ p and
accepting d iff x == d (then the token is x either way). So every emitted token is drawn
from the target's distribution at its position, whatever the drafts were
(tests/model/test_rejection_sampler.py checks it statistically on a small vocabulary).

`synthetic` acceptance (benchmarks, llama-server's `--spec-synth-rates`): draft j is
accepted with probability rates[j] / rates[j-1] given the one before it was, whatever the
target's sample; the token after the accepted ones is still the target's own. The output is
then not the model's, but a step costs what a real verification costs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from iterserve.core.request import SamplingParams
from iterserve.core.scheduler_output import SampleResult
from iterserve.core.spec_decode.ngram import SyntheticAcceptance


class DraftRow:
    """Row j of a verification: the request with its first j drafts accepted (what the
    Sampler reads of a row, core.scheduler_output.SamplingRow, plus its id)."""

    __slots__ = ("req_id", "prompt_token_ids", "output_token_ids", "sampling_params")

    def __init__(self, row, drafts: Sequence[int]) -> None:
        self.req_id = row.req_id
        self.prompt_token_ids = row.prompt_token_ids
        self.output_token_ids = list(row.output_token_ids) + list(drafts)
        self.sampling_params: SamplingParams = row.sampling_params


def verification_rows(rows: Sequence, drafts: dict[str, list[int]]) -> list:
    """The sampler's rows: a row without drafts as it is, one with k drafts as k + 1 rows."""
    out = []
    for row in rows:
        d = drafts.get(row.req_id)
        out.append(row)
        if d:
            out.extend(DraftRow(row, d[:j]) for j in range(1, len(d) + 1))
    return out


def verify(sampler, logits: torch.Tensor, rows: Sequence, drafts: dict[str, list[int]],
           synthetic: SyntheticAcceptance | None = None) -> list[SampleResult]:
    """One SampleResult per row of `rows` (in order): its token, or for a row with drafts the
    first of its tokens with the rest in `verified`. `logits` has the rows of
    `verification_rows(rows, drafts)`."""
    expanded = verification_rows(rows, drafts)
    if logits.shape[0] != len(expanded):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(expanded)} verified rows")
    sampled = sampler(logits, expanded)
    results: list[SampleResult] = []
    i = 0
    for row in rows:
        d = drafts.get(row.req_id)
        if not d:
            results.append(sampled[i])
            i += 1
            continue
        own = sampled[i:i + len(d) + 1]
        i += len(d) + 1
        if synthetic is not None:
            a = synthetic.accepted(len(d))
            chain = [SampleResult(t) for t in d[:a]] + [own[a]]
        else:
            a = 0
            while a < len(d) and own[a].token_id == d[a]:
                a += 1
            chain = own[:a + 1]
        first = chain[0]
        first.verified = chain[1:]
        results.append(first)
    return results
