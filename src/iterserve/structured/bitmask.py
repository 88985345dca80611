"""Batched token bitmasks: fill the constrained rows, apply them to the logits in one call.

A bitmask row holds one bit per vocabulary id (int32 words, bit t%32 of word t//32 is token
t; 1 = allowed), the layout xgrammar and llguidance share. Only constrained sequences have a
row; `rows` says which logits row each bitmask row belongs to.

`apply_bitmask` turns the packed bits into a 0 / -inf penalty with one byte-wise table lookup
and adds it: no Python loop over the vocabulary or the rows. The logits may be wider
than the mask (a model whose embedding table is padded past the tokenizer): the extra ids
are never allowed; a mask wider than the logits is cut to their width. Works on any device
(the mask is copied to the logits' device). The engine's masks are computed ahead per
sequence on a worker thread (structured/masks.py) and applied through `apply_bitmask`;
`PendingGrammarBitmask` is a whole step's fill on that thread (a step that verifies
speculative drafts, whose extra rows depend on the drafts).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from iterserve.structured.params import verify_row_id

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask [num_rows, ceil(vocab_size / 32)] on the CPU."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_bitmasks(matchers: Sequence, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """Row i of the result is `matchers[i]`'s mask (allocated when `bitmask` is None)."""
    if not matchers:
        raise ValueError("fill_bitmasks needs at least one matcher")
    if bitmask is None:
        bitmask = allocate_bitmask(len(matchers), matchers[0].grammar.vocab_size)
    for i, m in enumerate(matchers):
        m.fill_bitmask(bitmask, i)
    return bitmask


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return s


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """Bool [R, width]: True where the token is allowed (ids past the mask are False)."""
    device = bitmask.device
    r, w = bitmask.shape
    allowed = ((bitmask.unsqueeze(-1) >> _shifts(device)) & 1).view(r, w * 32).bool()
    if w * 32 >= width:
        return allowed[:, :width]
    pad = torch.zeros((r, width - w * 32), dtype=torch.bool, device=device)
    return torch.cat([allowed, pad], dim=1)


_PENALTY_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _penalty_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit is set and -inf where not."""
    key = (device, dtype)
    t = _PENALTY_TABLES.get(key)
    if t is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        t = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)
        _PENALTY_TABLES[key] = t
    return t


def bitmask_penalty(bitmask: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, width] of 0 (allowed) / -inf (forbidden), from the packed mask in one lookup.

    Adding this is the cheapest way found to mask on a CPU: a byte-wise table lookup
    (`embedding`) plus an add cost ~0.25 ms for 8 rows of a 49,152-token vocabulary, where
    unpacking to bools and `masked_fill` cost ~1.6 ms (same process, single thread).
    """
    r, w = bitmask.shape
    if sys.byteorder == "little":
        pen = F.embedding(bitmask.view(torch.uint8).long(),
                          _penalty_table(bitmask.device, dtype)).view(r, w * 32)
    else:   # bytes in the other order: unpack bits arithmetically
        allowed = ((bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1).view(r, w * 32)
        pen = torch.zeros(allowed.shape, dtype=dtype, device=bitmask.device).masked_fill_(
            allowed == 0, float("-inf"))
    if w * 32 >= width:
        return pen[:, :width]
    extra = torch.full((r, width - w * 32), float("-inf"), dtype=dtype, device=bitmask.device)
    return torch.cat([pen, extra], dim=1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """Set the forbidden logits of the constrained rows to -inf, in place; returns `logits`.

    `logits` [N, V]; `bitmask` [R, W] int32; `rows` the R logits rows the mask rows belong
    to (None: R == N, row i for row i).
    """
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits [N, V] and bitmask [R, W] expected, got "
                         f"{tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"the bitmask must be int32, got {bitmask.dtype}")
    n, vocab = logits.shape
    bitmask = bitmask.to(logits.device, non_blocking=True).contiguous()
    if rows is None:
        if bitmask.shape[0] != n:
            raise ValueError(f"{bitmask.shape[0]} mask rows for {n} logits rows; pass `rows`")
        return logits.add_(bitmask_penalty(bitmask, vocab, logits.dtype))
    idx = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
    if idx.numel() != bitmask.shape[0]:
        raise ValueError(f"{bitmask.shape[0]} mask rows but {idx.numel()} row indices")
    penalty = bitmask_penalty(bitmask, vocab, logits.dtype)
    if idx.numel() == n and bool((idx == torch.arange(n, device=idx.device)).all()):
        return logits.add_(penalty)
    sub = logits.index_select(0, idx).add_(penalty)
    return logits.index_copy_(0, idx, sub)


@dataclasses.dataclass(slots=True)
class GrammarBitmask:
    """One step's masks for the constrained sequences: `bitmask[row_of[seq_id]]`.

    Plain data the engine can put on the SchedulerOutput between schedule() and execute();
    the runner maps sequence ids to its logits rows (`apply`).
    """

    bitmask: torch.Tensor
    row_of: dict[str, int]

    failed: dict[str, str] = dataclasses.field(default_factory=dict)   # seq id -> error

    @classmethod
    def fill(cls, matchers: Mapping[str, object], *, isolate: bool = False,
             drafts: Mapping[str, Sequence[int]] | None = None) -> "GrammarBitmask | None":
        """Masks for `{seq_id: GrammarMatcher}` (None when there is none to fill).

        `isolate`: a matcher that fails leaves its row all-allowed and is named in `failed`
        (the caller ends that sequence) instead of failing the whole fill. `drafts`: the
        speculative drafts a sequence verifies this step; it gets one more row per draft,
        keyed `verify_row_id(seq_id, j)`: the mask after its first j drafts (the matcher
        takes them and gives them back)."""
        if not matchers:
            return None
        if drafts:
            return cls._fill_with_drafts(matchers, drafts, isolate)
        ids = list(matchers)
        if not isolate:
            bitmask = fill_bitmasks([matchers[i] for i in ids])
            return cls(bitmask, {sid: r for r, sid in enumerate(ids)})
        bitmask = allocate_bitmask(len(ids), next(iter(matchers.values())).grammar.vocab_size)
        failed: dict[str, str] = {}
        for r, sid in enumerate(ids):
            try:
                matchers[sid].fill_bitmask(bitmask, r)
            except Exception as e:             # noqa: BLE001 - reported per sequence
                bitmask[r].fill_(-1)
                failed[sid] = f"{type(e).__name__}: {e}"
        return cls(bitmask, {sid: r for r, sid in enumerate(ids)}, failed)

    @classmethod
    def _fill_with_drafts(cls, matchers: Mapping[str, object],
                          drafts: Mapping[str, Sequence[int]], isolate: bool
                          ) -> "GrammarBitmask":
        keys: list = []
        for sid in matchers:
            keys.append(sid)
            keys.extend(verify_row_id(sid, j) for j in range(1, len(drafts.get(sid, ())) + 1))
        bitmask = allocate_bitmask(len(keys), next(iter(matchers.values())).grammar.vocab_size)
        row_of = {key: r for r, key in enumerate(keys)}
        failed: dict[str, str] = {}
        for sid, m in matchers.items():
            r = row_of[sid]
            d = drafts.get(sid, ())
            taken = 0
            try:
                m.fill_bitmask(bitmask, r)
                for j, t in enumerate(d, 1):
                    if taken == j - 1 and m.accept(t):
                        taken += 1
                        m.fill_bitmask(bitmask, r + j)
                    else:          # never sampled past a refused draft: any mask will do
                        bitmask[r + j].copy_(bitmask[r + j - 1])
            except Exception as e:             # noqa: BLE001 - reported per sequence
                if not isolate:
                    raise
                bitmask[r:r + len(d) + 1].fill_(-1)
                failed[sid] = f"{type(e).__name__}: {e}"
            finally:
                if taken:
                    m.rollback(taken)
        return cls(bitmask, row_of, failed)

    def apply(self, logits: torch.Tensor, seq_ids: Sequence[str]) -> torch.Tensor:
        """`seq_ids[i]` is the sequence of logits row i (or a verification row's id,
        `verify_row_id`); rows without a mask are untouched."""
        rows, mask_rows = [], []
        for i, sid in enumerate(seq_ids):
            r = self.row_of.get(sid)
            if r is not None:
                rows.append(i)
                mask_rows.append(r)
        if not rows:
            return logits
        bm = self.bitmask if mask_rows == list(range(self.bitmask.shape[0])) else \
            self.bitmask[torch.tensor(mask_rows, dtype=torch.long)]
        return apply_bitmask(logits, bm, rows)


class PendingGrammarBitmask:
    """A step's GrammarBitmask being filled on the mask worker while the forward pass runs.

    Why: filling costs ~0.2-1 ms per constrained row (llguidance's mask computation over the
    whole vocabulary) and needs only the matchers' state after the previous step, not the
    logits; the forward pass runs in native code without the GIL. So the engine starts the
    fill before execute() and the runner's `apply` waits for it (usually done by then).
    Same interface as GrammarBitmask for the runner (`apply`); TP strips it like the other.
    """

    __slots__ = ("_future",)

    def __init__(self, future) -> None:
        self._future = future

    def result(self) -> GrammarBitmask:
        return self._future.result()

    @property
    def row_of(self) -> dict[str, int]:
        return self.result().row_of

    @property
    def bitmask(self) -> torch.Tensor:
        return self.result().bitmask

    def apply(self, logits: torch.Tensor, seq_ids: Sequence[str]) -> torch.Tensor:
        return self.result().apply(logits, seq_ids)

    def failed_rows(self) -> dict[str, str]:
        """Wait for the fill; the sequences whose matcher failed ({} if it all failed: the
        executor, which applies it, reported that already)."""
        try:
            return self._future.result().failed
        except Exception:                       # noqa: BLE001
            return {}
