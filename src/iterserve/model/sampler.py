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
4. the other rows: temperature, then top-k, top-p (smallest set of best tokens whose mass
   reaches p, always keeping the best one; top-k renormalises first), then min-p (drop
   tokens below `min_p * max prob`). Truncating rows work on their best tokens only, sorted:
   a full vocabulary sort is the slowest thing a sampler can do on a CPU.
5. an inverse-CDF draw: one uniform per row, the token where the row's cumulative
   probability passes it. One random number per row (instead of one per vocabulary entry,
   as an exponential race needs) keeps seeded rows cheap, and the draw is exact.

Seeds: a request with `seed` gets its uniform from a torch.Generator seeded by a hash of
(seed, number of output tokens so far). A request without one gets its uniform from a hash
of (the sampler's salt, its request id, number of output tokens so far) (splitmix64, no
generator object: a torch.Generator costs ~18 us a row here). Either way a row's draws are
its own: they repeat whatever else is in the batch, whatever row it sits in, and after
preemption by recompute or swap; the sampler keeps no per-request state. The salt is random
per Sampler unless `Sampler(seed=...)` fixes it (tests). A row object without a request id
(`req_id` / `request_id`) draws from one shared generator instead.

Batch invariance: every step above is row-wise and each row's arithmetic depends only on its
own logits and parameters: top-k / top-p work on each row's own candidate width (rows are
grouped by width, never widened to another row's), greedy ties go to the lowest token id
(numpy's first maximum), and top logprobs list equal values by token id.
"""

from __future__ import annotations

import os
import zlib
from typing import Sequence

import numpy as np
import torch

from iterserve.core.scheduler_output import SampleResult, SamplingRow
from iterserve.model.logits_processors import apply_logits_processors

GREEDY_TEMPERATURE = 1e-5   # at or below this, sampling is argmax (as vLLM's _SAMPLING_EPS)
_MASK64 = (1 << 64) - 1


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first maximum, as torch.argmax; int64 [N]).

    Why not torch.argmax on CPU: it splits an [N, 49k] reduction over the OpenMP threads, and
    on a 2-core machine the step then waits at a barrier for the second thread; same process,
    [8, 49152] float32: torch 225 us at 1 thread, 26.6 ms median at 2 threads on a loaded
    machine, numpy's single-threaded argmax 19 us at either (benchmarks/profile_decode.py saw
    aten::argmax take 7 ms of a 1.7B batch-8 step). numpy returns the first maximum too, and
    NaN counts as the maximum in both."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and not logits.requires_grad \
            and logits.shape[1] > 0:
        return torch.from_numpy(np.ascontiguousarray(logits.numpy()).argmax(axis=-1))
    return logits.argmax(dim=-1)


def _row_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): nearby seeds/steps get unrelated generator states."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _row_id(row) -> str | None:
    rid = getattr(row, "req_id", None)
    return rid if rid is not None else getattr(row, "request_id", None)


def _id_hash(rid: str) -> int:
    """A stable 64-bit hash of a request id (Python's str hash is salted per process)."""
    b = rid.encode()
    return zlib.crc32(b) | (zlib.adler32(b) << 32)


def _unit(z: int) -> float:
    """The top 24 bits of z as a float32-exact uniform in [0, 1), as torch.rand draws."""
    return (z >> 40) * (1.0 / (1 << 24))


class Sampler:
    """`sampler(logits [N, V] float32, rows) -> [SampleResult] * N`.

    A row is anything with `sampling_params`, `prompt_token_ids` and `output_token_ids`
    (core.scheduler_output.SamplingRow): the runner's own per-request state, not the
    scheduler's live Request.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        # mixes into every unseeded request's draws (module docstring)
        self._salt = seed if seed is not None else int.from_bytes(os.urandom(8), "little")

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

    def __call__(self, logits: torch.Tensor, requests: Sequence[SamplingRow]) -> list[SampleResult]:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [num_requests={len(requests)}, vocab], "
                             f"got {tuple(logits.shape)}")
        params = [r.sampling_params for r in requests]
        greedy = [p.temperature <= GREEDY_TEMPERATURE for p in params]
        want_logprobs = any(p.logprobs is not None for p in params)
        penalised = any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                        or p.frequency_penalty != 0.0 for p in params)
        processed = any(p.uses_logits_processors for p in params)
        if all(greedy) and not penalised and not want_logprobs and not processed:
            return [SampleResult(int(t)) for t in row_argmax(logits).tolist()]

        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if processed:
            logits = logits.clone()
            _apply_processors(logits, requests, params)
        if penalised:
            logits = apply_penalties(logits, requests)
        owned = penalised or processed
        if not any(greedy):
            tokens = self._sample_random(logits, requests, owned=owned)
        else:
            tokens = row_argmax(logits)
            random_rows = [i for i, g in enumerate(greedy) if not g]
            if random_rows:
                idx = torch.tensor(random_rows, device=logits.device)
                tokens[idx] = self._sample_random(logits[idx],
                                                  [requests[i] for i in random_rows], owned=True)

        token_list = tokens.tolist()
        if raw_logprobs is None:
            return [SampleResult(t) for t in token_list]
        return self._with_logprobs(raw_logprobs, tokens, token_list, params)

    def _uniforms(self, requests: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """One U[0, 1) per row: a seeded row's from its own (seed, step) generator, an unseeded
        row's from (salt, request id, step); rows without an id share one generator."""
        u = torch.empty(len(requests), device=device)
        unseeded = []
        own: dict[int, float] = {}
        for i, r in enumerate(requests):
            if r.sampling_params.seed is not None:
                continue
            rid = _row_id(r)
            if rid is None:
                unseeded.append(i)
            else:
                key = _row_seed(self._salt & _MASK64, _id_hash(rid))
                own[i] = _unit(_row_seed(key, len(r.output_token_ids)))
        if own:
            idx = list(own)
            u[torch.tensor(idx, device=device)] = torch.tensor([own[i] for i in idx],
                                                              dtype=u.dtype, device=device)
        if unseeded:
            draws = torch.rand(len(unseeded), device=device,
                               generator=self._shared_generator(device))
            if len(unseeded) == len(requests):
                u = draws
            else:
                u[torch.tensor(unseeded, device=device)] = draws
        for i, r in enumerate(requests):
            seed = r.sampling_params.seed
            if seed is not None:
                g = torch.Generator(device=device)
                g.manual_seed(_row_seed(seed, len(r.output_token_ids)))
                u[i] = torch.rand(1, device=device, generator=g)[0]
        return u

    def _sample_random(self, logits: torch.Tensor, requests: Sequence[SamplingRow], *,
                       owned: bool = False) -> torch.Tensor:
        """Temperature, truncation, then an inverse-CDF draw with one uniform per row.

        Rows that keep the whole vocabulary (no top-k, top-p 1) work on it unsorted; rows that
        truncate work on their best tokens only, sorted (see `truncated_candidates`).
        """
        params = [r.sampling_params for r in requests]
        device = logits.device
        if any(p.temperature != 1.0 for p in params):
            temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
            # `owned`: logits is this call's own copy (penalised or row-selected), so the
            # division can reuse its memory instead of writing another [N, V] tensor.
            logits = logits.div_(temps) if owned else logits / temps
        uniforms = self._uniforms(requests, device)
        vocab = logits.shape[1]
        full = [i for i, p in enumerate(params) if not 0 < p.top_k < vocab and p.top_p >= 1.0]
        cut = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        tokens = torch.empty(len(requests), dtype=torch.long, device=device)
        for rows, truncate in ((full, False), (cut, True)):
            if not rows:
                continue
            whole = len(rows) == len(requests)
            idx = None if whole else torch.tensor(rows, device=device)
            sub = logits if whole else logits[idx]
            sub_params = params if whole else [params[i] for i in rows]
            sub_uniforms = uniforms if whole else uniforms[idx]
            min_ps = [p.min_p for p in sub_params]
            if not truncate:
                drawn = draw(sub.softmax(dim=-1), None, min_ps, sub_uniforms)
            else:
                drawn = self._truncated_draw(sub, sub_params, min_ps, sub_uniforms)
            if whole:
                return drawn
            tokens[idx] = drawn
        return tokens

    @staticmethod
    def _truncated_draw(logits: torch.Tensor, params, min_ps: list[float],
                        uniforms: torch.Tensor) -> torch.Tensor:
        """Top-k / top-p rows, in groups of one candidate width each (a row's own, see
        `row_width`), so a row's probabilities never depend on the other rows' parameters."""
        vocab = logits.shape[1]
        device = logits.device
        drawn = torch.empty(logits.shape[0], dtype=torch.long, device=device)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault(row_width(p, vocab), []).append(i)
        for width, rows in groups.items():
            idx = torch.tensor(rows, device=device)
            sub, sub_params = logits[idx], [params[i] for i in rows]
            sub_min_ps, sub_u = [min_ps[i] for i in rows], uniforms[idx]
            probs, ids, exact = truncated_candidates(sub, sub_params, width=width)
            got = draw(probs, ids, sub_min_ps, sub_u)
            if not all(exact):   # nucleus wider than the prefiltered head: sort those rows
                redo = torch.tensor([j for j, ok in enumerate(exact) if not ok], device=device)
                probs, ids, _ = truncated_candidates(
                    sub[redo], [sub_params[j] for j in redo.tolist()], width=vocab)
                got[redo] = draw(probs, ids, [sub_min_ps[j] for j in redo.tolist()],
                                 sub_u[redo])
            drawn[idx] = got
        return drawn

    @staticmethod
    def _with_logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, token_list: list[int],
                       params) -> list[SampleResult]:
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        vocab = raw_logprobs.shape[1]
        k_max = max((p.logprobs or 0) for p in params)
        top_vals = top_ids = None
        if k_max > 0:
            # one more than asked, to see a tie at the boundary
            width = min(k_max + 1, vocab)
            top_vals, top_ids = raw_logprobs.topk(width, dim=-1)   # sorted, best first
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        out = []
        for i, (p, t) in enumerate(zip(params, token_list)):
            if p.logprobs is None:
                out.append(SampleResult(t))
                continue
            k = min(p.logprobs, vocab)
            top = []
            if k > 0:
                vals, ids = top_vals[i], top_ids[i]
                if k < len(vals) and vals[k] == vals[k - 1]:
                    # a tie across the boundary: which of the equal values topk kept depends
                    # on its width (the batch's largest k), so take them all by token id
                    edge = vals[k - 1]
                    row = raw_logprobs[i]
                    tied = torch.nonzero(row == edge).flatten().tolist()
                    above = [(tid, v) for tid, v in zip(ids, vals) if v > edge]
                    top = above + [(tid, edge) for tid in sorted(tied)][:k - len(above)]
                else:
                    top = list(zip(ids[:k], vals[:k]))
                top.sort(key=lambda e: (-e[1], e[0]))   # equal values by token id
            out.append(SampleResult(t, logprob=chosen[i], top_logprobs=top))
        return out


def _padded_ids(lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged id lists as one [N, W] tensor plus a validity mask.

    Each row is padded with its own first id (0 for an empty row), so a scatter of a value
    computed from the gathered logit writes that id's one correct value more than once and
    no other id is touched. (The padding must get the penalised value too: a scatter's
    duplicate writes land in no defined order, and a pad that wrote the unpenalised value
    would win or lose with the batch's widest row.) The mask says which entries are real.
    """
    width = max(len(x) for x in lists)
    rows = [x + [x[0] if x else 0] * (width - len(x)) for x in lists]
    valid = [[True] * len(x) + [False] * (width - len(x)) for x in lists]
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(valid, dtype=torch.bool, device=device))


def _apply_processors(logits: torch.Tensor, requests: Sequence[SamplingRow], params) -> None:
    """logit_bias, allowed_token_ids, bad_words and min_tokens (model/logits_processors), in
    place, batched over the rows that use them; after the raw logprobs, before penalties
    (vLLM's order)."""
    outputs = [r.output_token_ids for r in requests]
    apply_logits_processors(
        logits,
        logit_bias=[p.logit_bias for p in params],
        allowed_token_ids=[p.allowed_token_ids for p in params],
        bad_words=[p.bad_words_token_ids for p in params],
        min_tokens=[p.min_tokens for p in params],
        output_token_ids=outputs,
        stop_token_ids=[p.all_stop_token_ids or () for p in params])


def apply_penalties(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output) penalties, batched.

    Touches only the seen ids (gather, compute, scatter): the cost grows with the tokens a
    request has seen, not with the vocabulary. Returns a new tensor.
    """
    device = logits.device
    params = [r.sampling_params for r in requests]
    logits = logits.clone()

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)

    if any(p.repetition_penalty != 1.0 for p in params):
        seen = [(r.prompt_token_ids + r.output_token_ids) if p.repetition_penalty != 1.0 else []
                for r, p in zip(requests, params)]
        ids, valid = _padded_ids(seen, device)
        vals = logits.gather(1, ids)
        rep = column([p.repetition_penalty for p in params])
        penalised = torch.where(vals > 0, vals / rep, vals * rep)
        # every entry of a non-empty row is one of its seen ids (pads repeat the first)
        logits.scatter_(1, ids, torch.where(valid[:, :1], penalised, vals))
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    outputs = [r.output_token_ids for r in requests]
    if (any(freq) or any(pres)) and any(outputs):
        ids, valid = _padded_ids(outputs, device)
        if any(freq):   # one subtraction per occurrence: -f * count
            step = (-column(freq)).expand_as(ids) * valid
            logits.scatter_add_(1, ids, step)
        if any(pres):   # once per distinct id: duplicates write the same value
            vals = logits.gather(1, ids)
            logits.scatter_(1, ids, torch.where(valid[:, :1], vals - column(pres), vals))
    return logits


PREFILTER = 1024   # head of the sorted vocabulary tried before a full sort for top-p


def row_width(p, vocab: int) -> int:
    """The candidate width of a top-k / top-p row: its top_k, else the PREFILTER head."""
    k = p.top_k if 0 < p.top_k < vocab else 0
    return k if k else min(vocab, PREFILTER)


def truncated_candidates(logits: torch.Tensor, params, width: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """(probs [N, C], token ids [N, C], exact per row) for each row's best C tokens, best
    first, after top-k and top-p; dropped candidates have probability 0.

    Top-p needs tokens in order, and a full sort of the vocabulary is by far the slowest
    operation here (about 7 ms a row on this CPU, against 0.6 ms for the best 1,024), so by
    default only the best PREFILTER tokens are taken. Where they hold at least top_p of a
    row's mass the nucleus lies inside them and the row is exact; rows where they do not are
    reported (`exact` False) for the caller to redo with `width=vocab`. Top-k renormalises
    before top-p, as HF and vLLM do.
    """
    n, vocab = logits.shape
    device = logits.device
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if width is None:
        width = max(ks) if all(ks) else min(vocab, max(PREFILTER, max(ks)))
    has_k = torch.tensor([k > 0 for k in ks], device=device).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    cand, ids = logits.topk(width, dim=-1) if width < vocab else logits.sort(
        dim=-1, descending=True)
    pos = torch.arange(width, device=device).unsqueeze(0)
    k_row = torch.tensor([k or width for k in ks], device=device).unsqueeze(1)
    cand = cand.masked_fill(pos >= k_row, float("-inf"))
    best = cand[:, :1]
    # Normaliser: over the top-k set when the row has top-k, else over the whole row.
    norm = (cand - best).exp().sum(-1, keepdim=True)
    if width < vocab and not bool(has_k.all()):
        norm = torch.where(has_k, norm, (logits - best).exp().sum(-1, keepdim=True))
    probs = (cand - best).exp() / norm
    if width < vocab:
        exact = ((probs.sum(-1, keepdim=True) >= top_p) | has_k).squeeze(1).tolist()
    else:
        exact = [True] * n
    if bool((top_p < 1.0).any()):
        mass_before = probs.cumsum(dim=-1) - probs
        # The best token is always kept, even for a top_p that is 0 in float32 (5e-324).
        probs = probs.masked_fill((mass_before >= top_p) & (pos > 0), 0.0)
    return probs, ids, exact


def draw(probs: torch.Tensor, ids: torch.Tensor | None, min_ps: list[float],
         uniforms: torch.Tensor) -> torch.Tensor:
    """Min-p, then the token where each row's CDF passes its uniform (inverse-CDF sampling).

    Probabilities need not sum to 1: the uniform is scaled by the row total, and kept strictly
    below it so the search always lands on a token with non-zero probability.
    """
    if any(mp > 0.0 for mp in min_ps):
        mp = torch.tensor(min_ps, device=probs.device).unsqueeze(1)
        threshold = mp * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    pos = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)
    return (pos if ids is None else ids.gather(1, pos)).squeeze(1)
