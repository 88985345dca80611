"""Suffix decoding (`suffix`): proposals from the longest earlier occurrence of the context's
suffix, in the request's own tokens and in recent requests' outputs, by frequency.

Arctic Inference (vLLM's `suffix` method) keeps suffix trees: one per request over its
prompt and output, one global over finished requests' outputs. A proposal walks from the
node of the longest matching suffix of the context down the most frequent children. The
same answer comes from the occurrences themselves: the candidates are the places where the
context's last `KEY_LEN` tokens occurred; extending each match backwards gives its length,
the longest ones are the suffix's occurrences (the tree node), and counting what follows
them, token by token, is the walk down the children (a child's count over its parent's is
its probability). So this keeps per sequence only an index `KEY_LEN`-gram -> positions
(the `MAX_OCCURRENCES` most recent), O(tokens) memory and O(1) per appended token, and does
the walk on the occurrences when asked:

- matches longer than `max_depth` count as `max_depth` (the tree's depth);
- at most `max(1, int(match_len * max_spec_factor))` drafts (vLLM's
  `suffix_decoding_max_spec_factor`): a short match proposes little;
- the walk stops where the most frequent continuation's share of the occurrences drops
  below `min_token_prob`;
- the request's own tokens and the global outputs each give a proposal; the one with the
  larger expected number of accepted tokens (the sum of its prefixes' probabilities) wins.

The global cache keeps the outputs of the last `max_cached_requests` finished requests and
at most `MAX_GLOBAL_TOKENS` tokens, oldest evicted first; its index is rebuilt when evicted
entries make up half of it, so memory stays bounded whatever the traffic.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from iterserve.core.request import Request

KEY_LEN = 2                  # tokens a candidate must share with the context's end
MAX_OCCURRENCES = 16         # most recent occurrences kept per key (per sequence / globally)
MAX_GLOBAL_TOKENS = 1 << 20  # output tokens the global cache holds at most


def _add(index: dict, key: tuple, entry) -> None:
    lst = index.get(key)
    if lst is None:
        index[key] = [entry]
    else:
        lst.append(entry)
        if len(lst) > MAX_OCCURRENCES:
            del lst[0]


class _Walk:
    """The best proposal found so far: drafts and their expected accepted count."""

    __slots__ = ("tokens", "score")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.score = 0.0


def _match_len(ctx: Sequence[int], seq: Sequence[int], c: int, depth: int) -> int:
    """How many tokens before position c of seq equal the end of ctx (at most depth)."""
    n = len(ctx)
    m = 0
    lim = min(depth, c, n)
    while m < lim and seq[c - 1 - m] == ctx[n - 1 - m]:
        m += 1
    return m


def _walk(cands: list[tuple[Sequence[int], int]], match: int, k: int, factor: float,
          min_prob: float, best: _Walk) -> None:
    """Follow the most frequent continuation of the occurrences `cands` ((sequence, start
    of what follows), all matching `match` tokens); replace `best` if this one scores more."""
    limit = min(k, max(1, int(match * factor)))
    tokens: list[int] = []
    score = 0.0
    prob = 1.0
    d = 0
    while cands and len(tokens) < limit:
        counts: dict[int, int] = {}
        for seq, c in cands:
            if c + d < len(seq):
                t = seq[c + d]
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        # the most frequent; ties go to the most recent occurrence (the last candidate)
        top = max(counts.values())
        tok = next(seq[c + d] for seq, c in reversed(cands)
                   if c + d < len(seq) and counts[seq[c + d]] == top)
        share = top / len(cands)
        if share < min_prob:
            break
        prob *= share
        score += prob
        tokens.append(tok)
        cands = [(seq, c) for seq, c in cands if c + d < len(seq) and seq[c + d] == tok]
        d += 1
    if score > best.score:
        best.tokens, best.score = tokens, score


class SuffixProposer:
    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.max_cached = max_cached_requests
        self.factor = max_spec_factor
        self.min_prob = min_token_prob
        # per live request: key -> continuation starts in its own tokens, and how far indexed
        self._own: dict[str, tuple[dict, list[int]]] = {}
        # global: finished outputs by id (oldest first) and key -> [(doc id, start)]
        self._docs: OrderedDict[int, list[int]] = OrderedDict()
        self._global: dict[tuple, list[tuple[int, int]]] = {}
        self._next_doc = 0
        self._global_tokens = 0
        self._stale = 0            # index entries of evicted documents (for the rebuild)
        self._entries = 0

    def __len__(self) -> int:
        return len(self._own)

    @property
    def num_cached_requests(self) -> int:
        return len(self._docs)

    # --- per request ----------------------------------------------------------------------
    def _indexed(self, req: Request) -> dict:
        entry = self._own.get(req.request_id)
        if entry is None:
            entry = self._own[req.request_id] = ({}, [0])
        index, upto = entry
        tokens = req.all_token_ids
        end = len(tokens) - 1               # the last token has no continuation yet
        for e in range(max(upto[0], KEY_LEN - 1), end):
            _add(index, tuple(tokens[e + 1 - KEY_LEN:e + 1]), e + 1)
        if end > upto[0]:
            upto[0] = end
        return index

    def propose(self, req: Request, k: int) -> list[int]:
        tokens = req.all_token_ids
        if k <= 0 or len(tokens) < KEY_LEN:
            return []
        key = tuple(tokens[-KEY_LEN:])
        best = _Walk()
        depth = self.max_depth
        own = self._indexed(req).get(key)
        if own:
            self._best_of([(tokens, c) for c in own], tokens, depth, k, best)
        glob = self._global.get(key)
        if glob:
            docs = self._docs
            cands = [(docs[d], c) for d, c in glob if d in docs]
            if cands:
                self._best_of(cands, tokens, depth, k, best)
        return best.tokens

    def _best_of(self, cands: list[tuple[Sequence[int], int]], ctx: Sequence[int],
                 depth: int, k: int, best: _Walk) -> None:
        lens = [_match_len(ctx, seq, c, depth) for seq, c in cands]
        m = max(lens)
        _walk([cd for cd, n in zip(cands, lens) if n == m], m, k, self.factor,
              self.min_prob, best)

    # --- finished requests ----------------------------------------------------------------
    def finish(self, req: Request) -> None:
        """Forget the request's own index and cache its output for the requests to come."""
        self._own.pop(req.request_id, None)
        out = list(req.output_token_ids)
        if self.max_cached <= 0 or len(out) <= KEY_LEN:
            return
        doc = self._next_doc
        self._next_doc += 1
        self._docs[doc] = out
        self._global_tokens += len(out)
        for e in range(KEY_LEN - 1, len(out) - 1):
            _add(self._global, tuple(out[e + 1 - KEY_LEN:e + 1]), (doc, e + 1))
            self._entries += 1
        while self._docs and (len(self._docs) > self.max_cached
                              or self._global_tokens > MAX_GLOBAL_TOKENS):
            _, old = self._docs.popitem(last=False)
            self._global_tokens -= len(old)
            self._stale += max(0, len(old) - KEY_LEN)
        if self._stale * 2 > self._entries:
            self._rebuild()

    def _rebuild(self) -> None:
        docs = self._docs
        index: dict[tuple, list[tuple[int, int]]] = {}
        n = 0
        for key, lst in self._global.items():
            live = [e for e in lst if e[0] in docs]
            if live:
                index[key] = live
                n += len(live)
        self._global, self._entries, self._stale = index, n, 0

    def drop(self, request_id: str) -> None:
        self._own.pop(request_id, None)
