"""Pick each request's next token from its logits row, for a whole batch at once.

All the processing is row-wise tensor work over the [N, V] logits (no Python loop over the
vocabulary), in vLLM's order:

1. logprobs, when any request asks, from the log-softmax of the *raw* logits: what the model
   believes before penalties, temperature and truncation (vLLM's default `raw_logprobs`).
   The sampled token's logprob is reported even when truncation made it a sure thing.
2. penalties: repetition (HF/CTRL style: a seen token's positive logit is divided by the
   penalty, a negative one multiplied; "seen" covers prompt and output tokens), then
   frequency (minus `f * count` in the output) and presence (minus `p` if in the output)
   as OpenAI defines them.
3. greedy rows (temperature <= 1e-5) take the argmax of the penalised logits.
4. the other rows: temperature, then top-k, top-p (smallest set of tokens whose mass reaches
   p, always keeping the best one), then min-p (drop tokens below `min_p * max prob`).
5. a draw by "exponential race": argmax(probs / E) with E ~ Exp(1) per token, which samples
   exactly from probs and lets each row use its own noise source.

Seeds: a request with `seed` gets noise from a torch.Generator seeded by a hash of
(seed, number of output tokens so far). Its tokens therefore repeat whatever else is in the
batch, whatever row it sits in, and even after preemption and recompute; the sampler keeps no
per-request state. Unseeded rows share one generator (`Sampler(seed=...)` fixes it for tests).
"""

from __future__ import annotations

from typing import Sequence

import torch

from iterserve.core.request import Request
from iterserve.core.scheduler_output import SampleResult

GREEDY_TEMPERATURE = 1e-5   # at or below this, sampling is argmax (as vLLM's _SAMPLING_EPS)
_MASK64 = (1 << 64) - 1


def _row_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): nearby seeds/steps get unrelated generator states."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """`sampler(logits [N, V] float32, requests) -> [SampleResult] * N`."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            if self._seed is None:
                g.seed()
            else:
                g.manual_seed(self._seed)
            self._generators[device] = g
        return g

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[SampleResult]:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [num_requests={len(requests)}, vocab], "
                             f"got {tuple(logits.shape)}")
        params = [r.sampling_params for r in requests]
        greedy = [p.temperature <= GREEDY_TEMPERATURE for p in params]
        want_logprobs = any(p.logprobs is not None for p in params)
        penalised = any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                        or p.frequency_penalty != 0.0 for p in params)
        if all(greedy) and not penalised and not want_logprobs:
            return [SampleResult(int(t)) for t in logits.argmax(dim=-1).tolist()]

        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if penalised:
            logits = apply_penalties(logits, requests)
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            rows = [requests[i] for i in random_rows]
            probs = processed_probs(logits[idx], [r.sampling_params for r in rows])
            tokens[idx] = self._race(probs, rows)

        token_list = tokens.tolist()
        if raw_logprobs is None:
            return [SampleResult(t) for t in token_list]
        return self._with_logprobs(raw_logprobs, tokens, token_list, params)

    def _race(self, probs: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """argmax(probs / E), E ~ Exp(1): a seeded row draws E from its own generator."""
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(requests) if r.sampling_params.seed is None]
        if unseeded:
            shared = self._shared_generator(probs.device)
            if len(unseeded) == len(requests):
                noise.exponential_(generator=shared)
            else:
                idx = torch.tensor(unseeded, device=probs.device)
                noise[idx] = torch.empty((len(unseeded), probs.shape[1]), device=probs.device
                                         ).exponential_(generator=shared)
        for i, r in enumerate(requests):
            seed = r.sampling_params.seed
            if seed is not None:
                g = torch.Generator(device=probs.device)
                g.manual_seed(_row_seed(seed, r.num_output_tokens))
                noise[i].exponential_(generator=g)
        return probs.div_(noise).argmax(dim=-1)

    @staticmethod
    def _with_logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, token_list: list[int],
                       params) -> list[SampleResult]:
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        k_max = max((p.logprobs or 0) for p in params)
        top_vals = top_ids = None
        if k_max > 0:
            k_max = min(k_max, raw_logprobs.shape[1])
            top_vals, top_ids = raw_logprobs.topk(k_max, dim=-1)   # sorted, best first
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        out = []
        for i, (p, t) in enumerate(zip(params, token_list)):
            if p.logprobs is None:
                out.append(SampleResult(t))
                continue
            k = min(p.logprobs, raw_logprobs.shape[1])
            top = list(zip(top_ids[i][:k], top_vals[i][:k])) if k > 0 else []
            out.append(SampleResult(t, logprob=chosen[i], top_logprobs=top))
        return out


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output) penalties, batched.

    Token ids are padded with an extra column V that is dropped after the scatter, so ragged
    per-request lists become one scatter_add over [N, V + 1].
    """
    n, vocab = logits.shape
    device = logits.device

    def counts_of(lists: list[list[int]]) -> torch.Tensor:
        width = max((len(x) for x in lists), default=0)
        if width == 0:
            return torch.zeros((n, vocab), device=device)
        ids = torch.full((n, width), vocab, dtype=torch.long)
        for i, x in enumerate(lists):
            if x:
                ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        ids = ids.to(device)
        counts = torch.zeros((n, vocab + 1), device=device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
        return counts[:, :vocab]

    params = [r.sampling_params for r in requests]
    out_counts = counts_of([r.output_token_ids for r in requests])
    logits = logits.clone()
    rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    if (rep != 1.0).any():
        prompt_counts = counts_of([r.prompt_token_ids if p.repetition_penalty != 1.0 else []
                                   for r, p in zip(requests, params)])
        seen = (prompt_counts + out_counts) > 0
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    logits -= freq * out_counts + pres * (out_counts > 0).to(logits.dtype)
    return logits


def processed_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p; returns probabilities (zeros outside the support)."""
    device = logits.device
    n, vocab = logits.shape
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temps
    neg_inf = torch.tensor(float("-inf"), device=device)

    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in ks):
        k_max = max(k for k in ks if k < vocab)
        top = logits.topk(k_max, dim=-1).values
        k_idx = torch.tensor([min(k, k_max) - 1 for k in ks], device=device).unsqueeze(1)
        kth = top.gather(1, k_idx)
        kth = torch.where(torch.tensor([k < vocab for k in ks], device=device).unsqueeze(1),
                          kth, neg_inf)
        logits = torch.where(logits < kth, neg_inf, logits)

    top_ps = [p.top_p for p in params]
    if any(tp < 1.0 for tp in top_ps):
        rows = [i for i, tp in enumerate(top_ps) if tp < 1.0]
        idx = torch.tensor(rows, device=device)
        sub = logits[idx]
        sorted_logits, order = sub.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = torch.tensor([top_ps[i] for i in rows], device=device).unsqueeze(1)
        drop_sorted = mass_before >= p          # the best token has mass_before 0: always kept
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits[idx] = sub.masked_fill(drop, float("-inf"))

    probs = logits.softmax(dim=-1)
    min_ps = [p.min_p for p in params]
    if any(mp > 0.0 for mp in min_ps):
        mp = torch.tensor(min_ps, device=device).unsqueeze(1)
        threshold = mp * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
    return probs
