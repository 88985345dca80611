"""Per-request logits edits the sampler applies row-wise: logit_bias, allowed_token_ids,
bad_words and min_tokens, as OpenAI and vLLM define them.

Every function takes the batch's logits [N, V] and one entry per row (None, or an empty
value, for a row that does not use the feature) and edits the logits in place. The work is
one scatter (`index_put_`) or one masked_fill per feature over the touched (row, token)
pairs: no Python loop over the vocabulary. The loops that remain walk a request's own
lists (its bias entries, its bad words), which are short.

Order (vLLM's sampler): after the raw logprobs are taken and before penalties and
temperature: allowed_token_ids, bad_words, then min_tokens and logit_bias.
`apply_logits_processors` does all four in that order.

The validation functions (`validate_logit_bias`, `validate_token_ids`) and
`bad_words_token_ids` belong to the request side (the input processor): they turn request
fields into the ids these functions take and raise `LogitsParamError` (a ValueError naming
the field) for a 400.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import torch

from iterserve.errors import LogitsParamError



LOGIT_BIAS_LIMIT = 100.0     # OpenAI's range for logit_bias values


# --- request side -------------------------------------------------------------------------
def validate_logit_bias(logit_bias: Mapping[Any, Any] | None, vocab_size: int,
                        param: str = "logit_bias") -> dict[int, float] | None:
    """OpenAI's `{"token id": bias}` (keys are strings in JSON) as {int: float}, each bias
    clamped to [-100, 100] as vLLM does. Out-of-vocabulary ids and non-numbers are errors."""
    if not logit_bias:
        return None
    out: dict[int, float] = {}
    for key, bias in logit_bias.items():
        try:
            token = int(key)
            if isinstance(key, float) or str(token) != str(key).strip():
                raise ValueError
        except (TypeError, ValueError):
            raise LogitsParamError(f"{param} keys must be token ids, got {key!r}", param) from None
        if not 0 <= token < vocab_size:
            raise LogitsParamError(f"{param} has token id {token}, outside the vocabulary "
                                   f"[0, {vocab_size})", param)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise LogitsParamError(f"{param}[{key!r}] must be a finite number, got {bias!r}",
                                   param)
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(bias)))
    return out


def validate_token_ids(token_ids: Iterable[Any] | None, vocab_size: int, param: str,
                       *, allow_empty: bool = False) -> list[int] | None:
    """A list of token ids inside [0, vocab_size) (e.g. `allowed_token_ids`)."""
    if token_ids is None:
        return None
    ids = list(token_ids)
    if not ids and not allow_empty:
        raise LogitsParamError(f"{param} must not be empty", param)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise LogitsParamError(f"{param} must be a list of token ids, got {t!r}", param)
        if not 0 <= t < vocab_size:
            raise LogitsParamError(f"{param} has token id {t}, outside the vocabulary "
                                   f"[0, {vocab_size})", param)
    return ids


def bad_words_token_ids(tokenizer: Any, bad_words: Sequence[str] | None,
                        param: str = "bad_words") -> list[list[int]]:
    """Token sequences for `bad_words`: each word as it would start the text and, when that
    tokenises differently, as it would appear after a space (a new word mid-text).

    vLLM keeps the spaced form only when it has as many tokens as the plain one, so a word
    like " fox" (one token) after "fox" (two) would slip through there; here it is blocked.
    """
    out: list[list[int]] = []
    for word in bad_words or ():
        if not isinstance(word, str) or not word.strip():
            raise LogitsParamError(f"{param} must be a list of non-empty strings", param)
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced != plain:
            out.append(spaced)
    return out


# --- the tensor side ------------------------------------------------------------------------
def _put(logits: torch.Tensor, rows: list[int], cols: list[int], values: Any, *,
         accumulate: bool = False) -> None:
    if not rows:
        return
    device = logits.device
    r = torch.tensor(rows, dtype=torch.long, device=device)
    c = torch.tensor(cols, dtype=torch.long, device=device)
    v = values if isinstance(values, torch.Tensor) else torch.as_tensor(
        values, dtype=logits.dtype, device=device)
    logits.index_put_((r, c), v.expand(r.shape) if v.dim() == 0 else v, accumulate=accumulate)


def apply_logit_bias(logits: torch.Tensor,
                     biases: Sequence[Mapping[int, float] | None]) -> torch.Tensor:
    """Add each row's {token id: bias} to its logits (ids are unique per row)."""
    rows, cols, vals = [], [], []
    for i, bias in enumerate(biases):
        if bias:
            rows.extend([i] * len(bias))
            cols.extend(bias.keys())
            vals.extend(bias.values())
    if rows:
        _put(logits, rows, cols, torch.tensor(vals, dtype=logits.dtype, device=logits.device),
             accumulate=True)
    return logits


def apply_allowed_token_ids(logits: torch.Tensor,
                            allowed: Sequence[Sequence[int] | None]) -> torch.Tensor:
    """Rows with a list keep only those ids; every other id gets -inf."""
    used = [i for i, a in enumerate(allowed) if a]
    if not used:
        return logits
    n, vocab = logits.shape
    keep = torch.zeros((len(used), vocab), dtype=torch.bool, device=logits.device)
    krow, kcol = [], []
    for j, i in enumerate(used):
        krow.extend([j] * len(allowed[i]))
        kcol.extend(allowed[i])
    keep[torch.tensor(krow, dtype=torch.long, device=logits.device),
         torch.tensor(kcol, dtype=torch.long, device=logits.device)] = True
    if len(used) == n:
        return logits.masked_fill_(~keep, float("-inf"))
    idx = torch.tensor(used, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, idx).masked_fill_(~keep, float("-inf"))
    return logits.index_copy_(0, idx, sub)


def apply_bad_words(logits: torch.Tensor, bad_words: Sequence[Sequence[Sequence[int]] | None],
                    output_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Block the token that would complete a bad word: a one-token word always, a longer
    one when the output so far ends with all of the word but its last token (vLLM's rule;
    only output tokens count, not the prompt)."""
    rows, cols = [], []
    for i, words in enumerate(bad_words):
        if not words:
            continue
        out = output_token_ids[i]
        for word in words:
            if not word:
                continue
            prefix = len(word) - 1
            if prefix == 0 or (len(out) >= prefix and list(out[-prefix:]) == list(word[:-1])):
                rows.append(i)
                cols.append(word[-1])
    _put(logits, rows, cols, float("-inf"))
    return logits


def apply_min_tokens(logits: torch.Tensor, min_tokens: Sequence[int | None],
                     num_output_tokens: Sequence[int],
                     stop_token_ids: Sequence[Iterable[int]]) -> torch.Tensor:
    """Until a row has `min_tokens` outputs, its EOS and stop token ids get -inf.
    `stop_token_ids[i]`: that row's EOS ids and its request's stop_token_ids together."""
    rows, cols = [], []
    for i, m in enumerate(min_tokens):
        if m and num_output_tokens[i] < m:
            ids = list(stop_token_ids[i])
            rows.extend([i] * len(ids))
            cols.extend(ids)
    _put(logits, rows, cols, float("-inf"))
    return logits


def apply_logits_processors(
    logits: torch.Tensor, *,
    logit_bias: Sequence[Mapping[int, float] | None] | None = None,
    allowed_token_ids: Sequence[Sequence[int] | None] | None = None,
    bad_words: Sequence[Sequence[Sequence[int]] | None] | None = None,
    min_tokens: Sequence[int | None] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
    stop_token_ids: Sequence[Iterable[int]] | None = None,
) -> bool:
    """All four, in vLLM's order, in place; True if any row used any of them.

    `output_token_ids` is needed for bad_words and min_tokens; `stop_token_ids` (EOS plus the
    request's stop ids, per row) for min_tokens.
    """
    used = False
    if allowed_token_ids is not None and any(allowed_token_ids):
        apply_allowed_token_ids(logits, allowed_token_ids)
        used = True
    if bad_words is not None and any(bad_words):
        if output_token_ids is None:
            raise ValueError("bad_words needs output_token_ids")
        apply_bad_words(logits, bad_words, output_token_ids)
        used = True
    if min_tokens is not None and any(min_tokens):
        if output_token_ids is None or stop_token_ids is None:
            raise ValueError("min_tokens needs output_token_ids and stop_token_ids")
        apply_min_tokens(logits, min_tokens, [len(o) for o in output_token_ids], stop_token_ids)
        used = True
    if logit_bias is not None and any(logit_bias):
        apply_logit_bias(logits, logit_bias)
        used = True
    return used
