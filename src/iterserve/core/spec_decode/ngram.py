"""Proposals from the request's own tokens (`ngram`, prompt lookup) and for benchmarks
(`synthetic`), and the placeholders of a draft model's (`draft_model`).

A proposer is asked `propose(request, k)` after the request got its tokens of a step and
answers up to k draft tokens (possibly none); `drop(request_id)` forgets what it keeps for a
request that finished or left. Proposers are pure Python and keep at most O(tokens of the
live requests) state.
"""

from __future__ import annotations

import random
from typing import Sequence

from iterserve.core.request import Request

DRAFT_PLACEHOLDER = -1     # a draft token the executor proposes itself (a draft model)


class _NgramIndex:
    """For each n in [lo, hi]: n-gram -> where what followed its most recent occurrence
    starts, over the request's tokens indexed so far (`upto`: n-grams ending before it)."""

    __slots__ = ("maps", "upto")

    def __init__(self, num_sizes: int) -> None:
        self.maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_sizes)]
        self.upto = 0


class NgramProposer:
    """vLLM's `ngram` method (prompt lookup decoding): the longest n-gram, n in
    [prompt_lookup_min, prompt_lookup_max], of the request's last tokens that occurred
    earlier in its prompt or output; the tokens that followed it are the drafts.

    Where vLLM searches the whole sequence each step (KMP, in numba), this keeps an index
    per request that grows by one entry per size and token, so a proposal costs one dict
    lookup per size: O(1) per step, O(tokens x sizes) memory, freed with the request. Of
    several occurrences the most recent wins (an edit quoted back follows the copy it is
    in, not the first one in the prompt); where what followed it runs into the end of the
    sequence, the drafts continue the repetition.""" 

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self._index: dict[str, _NgramIndex] = {}

    def __len__(self) -> int:
        return len(self._index)

    def _indexed(self, req: Request) -> _NgramIndex:
        idx = self._index.get(req.request_id)
        if idx is None:
            idx = self._index[req.request_id] = _NgramIndex(self.hi - self.lo + 1)
        tokens = req.all_token_ids
        end = len(tokens) - 1            # the last token has nothing after it yet
        lo, maps = self.lo, idx.maps
        for e in range(idx.upto, end):   # n-grams ending at token e, continued at e + 1
            for i, m in enumerate(maps):
                n = lo + i
                if e + 1 >= n:
                    m[tuple(tokens[e + 1 - n:e + 1])] = e + 1
        if end > idx.upto:
            idx.upto = end
        return idx

    def propose(self, req: Request, k: int) -> list[int]:
        if k <= 0:
            return []
        idx = self._indexed(req)
        tokens = req.all_token_ids
        n_tokens = len(tokens)
        for i in range(min(self.hi, n_tokens - 1) - self.lo, -1, -1):
            n = self.lo + i
            start = idx.maps[i].get(tuple(tokens[n_tokens - n:]))
            if start is not None:
                drafts = tokens[start:start + k]
                # What follows a recent occurrence runs into the end: the text repeats with
                # period n_tokens - start, and so do the drafts.
                period = n_tokens - start
                while len(drafts) < k:
                    drafts.append(drafts[len(drafts) - period])
                return drafts
        return []

    def drop(self, request_id: str) -> None:
        self._index.pop(request_id, None)


class SyntheticProposer:
    """`synthetic` (benchmarks): always k drafts, copies of the last token (acceptance is
    decided by the executor from `acceptance_rates`, not by what the drafts are). None when
    the last token is the request's EOS, which an accepted copy would end it on."""

    def propose(self, req: Request, k: int) -> list[int]:
        last = req.all_token_ids[-1]
        if k <= 0 or last == req.eos_token_id:
            return []
        return [last] * k

    def drop(self, request_id: str) -> None:
        pass

    def __len__(self) -> int:
        return 0


class SyntheticAcceptance:
    """`synthetic`'s verification: how many of k drafts are accepted, drawn from the
    unconditional per-position rates (non-increasing: draft j given draft j-1 with
    rates[j] / rates[j-1]). Here, torch-free, because both verifiers draw from it: the model
    runner (model/rejection_sampler.py) and the lab's SimExecutor."""

    def __init__(self, rates: Sequence[float], seed: int = 0) -> None:
        prev = 1.0
        self.conditional = []
        for r in rates:
            self.conditional.append(r / prev if prev > 0 else 0.0)
            prev = r
        self._rng = random.Random(seed)

    def accepted(self, num_drafts: int) -> int:
        a = 0
        cond = self.conditional
        while a < num_drafts and a < len(cond) and self._rng.random() < cond[a]:
            a += 1
        return a


class DraftModelProposer:
    """`draft_model`: the executor's draft model proposes at the start of the verification
    step itself; the scheduler side only reserves k slots (placeholders), so the drafts
    count against the budget and the KV blocks like any token."""

    def propose(self, req: Request, k: int) -> list[int]:
        # A constrained sequence gets none: its grammar vets drafts before the step is
        # scheduled (engine draft_limits), and these are made in the executor after it.
        if k <= 0 or req.sampling_params.structured_outputs is not None:
            return []
        return [DRAFT_PLACEHOLDER] * k

    def drop(self, request_id: str) -> None:
        pass

    def __len__(self) -> int:
        return 0
