"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs = k`): for every prompt position
after the first, the logprob of the prompt's actual next token, its rank in the vocabulary,
and the top-k alternatives.

Why its own pass: the runner computes logits only at the rows that sample (the last token of
a chunk reaching the request's end); a request that asks for prompt logprobs needs the LM head
over its prompt rows too. The runner calls `chunk_prompt_logprobs` for each chunk of such a
request (chunked prefill: per chunk, so a long prompt never holds [prompt, vocab] logits at
once; rows are further taken `ROWS_PER_PASS` at a time) and keeps the entries until the
request samples its first token, when they ride back on its SampleResult.

Values are the log-softmax of the *raw* logits (no logit_bias, penalties or temperature), as
vLLM reports them. Rank is 1 + the number of tokens with a strictly higher logprob (vLLM's
definition; the best token has rank 1).
"""

from __future__ import annotations

from typing import Callable

import torch

ROWS_PER_PASS = 256     # prompt rows per LM-head call: 256 x 49k float32 logits = 50 MB

Entry = tuple[int, float, int, list[tuple[int, float]]]   # (token, logprob, rank, top-k)


def chunk_prompt_logprobs(logits_fn: Callable[[torch.Tensor], torch.Tensor],
                          hidden: torch.Tensor, next_token_ids: list[int], k: int) -> list[Entry]:
    """Entries for the rows of `hidden` [R, H], row r predicting `next_token_ids[r]`.

    `logits_fn` is the model's LM head (hidden -> float32 logits [R, V])."""
    out: list[Entry] = []
    for lo in range(0, len(next_token_ids), ROWS_PER_PASS):
        targets = next_token_ids[lo:lo + ROWS_PER_PASS]
        with torch.inference_mode():
            lp = torch.log_softmax(logits_fn(hidden[lo:lo + len(targets)]).float(), dim=-1)
            tgt = torch.tensor(targets, dtype=torch.long, device=lp.device).unsqueeze(1)
            chosen = lp.gather(1, tgt)
            ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
            chosen = chosen.squeeze(1).tolist()
            kk = min(k, lp.shape[1])
            if kk > 0:
                vals, ids = lp.topk(kk, dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
            else:
                tops = [[] for _ in targets]
        out.extend(zip(targets, chosen, ranks, tops))
    return out
