"""Grammar masks computed ahead, on a worker thread, and never waited on for long.

Why: a mask costs llguidance ~0.2-1 ms per constrained sequence for an ordinary schema, but
a hard grammar costs far more (a right-recursive rule 30-70 ms a token by its 800th token,
a large regex 0.5 s and up at its first). Filled in the step, a slow mask is a slow step for
every stream. So:

- `MaskFiller.prefetch(seq, matcher)` starts the mask of a sequence's next token as soon as
  its matcher has its state: right after its token was accepted (or when it is added), so
  the mask is computed during the rest of that step, the scheduling of the next one and
  its forward pass.
- `MaskFiller.step(sampling)` is the step's `StepMasks`; the runner's `apply` waits for the
  masks only until the logits are ready plus a grace (`MIN_WAIT_S`, or `WAIT_FRACTION` of
  the step so far), and a sequence whose mask is still being computed **sits the step out**:
  the runner samples no token for it (`deferred`), the engine counts one token less as
  computed for it (so the scheduler schedules that token again), and its mask, still
  computing, is ready for a later step. The batch never waits for one sequence's grammar.

A job is keyed by the matcher and its token count, so a deferred sequence reuses the mask
it waited for, and a matcher is never read by the worker while the engine thread advances
it: a sequence samples (and its matcher accepts) only once its job is done.

Masks that fail (the grammar engine errs) are reported per sequence (`failed_rows`), as the
fill did before; the engine ends those sequences.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Mapping, Sequence

import torch

from iterserve.structured.bitmask import apply_bitmask
from iterserve.structured.workers import WorkerPool

MIN_WAIT_S = 0.002          # after the logits: a mask that is almost done still makes it
WAIT_FRACTION = 0.1         # ... or a tenth of the step's time so far, if longer
ALONE_WAIT_S = 0.05         # every sequence of the step waits on its mask: nobody else waits


def _fill(matcher: Any) -> tuple[torch.Tensor | None, str | None, float]:
    """(row [1, W], None, seconds) or (None, the error, seconds); on the worker thread."""
    t0 = time.perf_counter()
    row = torch.empty((1, matcher.grammar.bitmask_width), dtype=torch.int32)
    try:
        matcher.fill_bitmask(row, 0)
    except Exception as e:                     # noqa: BLE001 - reported per sequence
        return None, f"{type(e).__name__}: {e}", time.perf_counter() - t0
    return row, None, time.perf_counter() - t0


class MaskFiller:
    """The per-sequence mask jobs of one engine (its output processor owns it)."""

    def __init__(self) -> None:
        self._pool = WorkerPool("grammar-mask", 1)
        # scheduler id -> (matcher, its token count when the job started, future)
        self._jobs: dict[str, tuple[Any, int, concurrent.futures.Future]] = {}
        self.num_deferred = 0                  # sequence-steps sat out, ever

    def prefetch(self, seq_id: str, matcher: Any) -> concurrent.futures.Future:
        """The job computing `matcher`'s mask at its current state (started if needed)."""
        job = self._jobs.get(seq_id)
        if job is not None and job[0] is matcher and job[1] == matcher.num_tokens:
            return job[2]
        fut = self._pool.submit(_fill, matcher)
        self._jobs[seq_id] = (matcher, matcher.num_tokens, fut)
        return fut

    def settle(self, seq_id: str) -> None:
        """Wait for `seq_id`'s mask job, if any, so the engine thread may use its matcher
        (taking drafts and giving them back leaves the job's mask valid)."""
        job = self._jobs.get(seq_id)
        if job is not None:
            concurrent.futures.wait([job[2]])

    def step_with_drafts(self, sampling: Mapping[str, Any],
                         drafts: Mapping[str, Sequence[int]]) -> Any:
        """A step that verifies speculative drafts: all its masks, with a row per draft,
        filled as one job on the mask worker (so never beside another job on a matcher),
        waited for by the runner (GrammarBitmask.fill with `drafts`)."""
        from iterserve.structured.bitmask import GrammarBitmask, PendingGrammarBitmask
        return PendingGrammarBitmask(
            self._pool.submit(GrammarBitmask.fill, sampling, isolate=True, drafts=drafts))

    def forget(self, seq_id: str) -> None:
        self._jobs.pop(seq_id, None)

    def step(self, sampling: Mapping[str, Any], *, num_scheduled: int = 0) -> "StepMasks":
        """This step's masks for `{seq id: matcher}` (the sequences that sample in it);
        `num_scheduled`: the sequences the step runs. When every one of them would sit out,
        waiting longer (ALONE_WAIT_S) delays nobody and saves recomputing their tokens."""
        return StepMasks({sid: self.prefetch(sid, m) for sid, m in sampling.items()}, self,
                         num_scheduled)

    def close(self) -> None:
        self._pool.shutdown()


class StepMasks:
    """One step's masks, for the runner (`apply`, then `deferred`) and the output processor
    (`failed_rows`); the engine reads `deferred` to let those sequences sit the step out."""

    __slots__ = ("_futures", "_filler", "_num_scheduled", "_t0", "deferred", "failed",
                 "_applied")

    def __init__(self, futures: dict[str, concurrent.futures.Future], filler: MaskFiller,
                 num_scheduled: int = 0) -> None:
        self._futures = futures
        self._filler = filler
        self._num_scheduled = num_scheduled
        self._t0 = time.perf_counter()
        self.deferred: set[str] = set()
        self.failed: dict[str, str] = {}
        self._applied = False

    @property
    def row_of(self) -> dict[str, int]:
        """The sequences this step has masks for (GrammarBitmask's spelling)."""
        return {sid: i for i, sid in enumerate(self._futures)}

    def _wait(self) -> None:
        pending = [f for f in self._futures.values() if not f.done()]
        if pending:
            elapsed = time.perf_counter() - self._t0
            wait = max(MIN_WAIT_S, WAIT_FRACTION * elapsed)
            if len(pending) >= self._num_scheduled:
                wait = max(wait, ALONE_WAIT_S)
            concurrent.futures.wait(pending, timeout=wait)

    def apply(self, logits: torch.Tensor, seq_ids: Sequence[str]) -> torch.Tensor:
        """Mask the logits rows of the sequences whose masks are ready; the others are
        `deferred` (the caller samples no token for them this step)."""
        self._wait()
        rows, masks = [], []
        for i, sid in enumerate(seq_ids):
            fut = self._futures.get(sid)
            if fut is None:
                continue
            if not fut.done():
                self.deferred.add(sid)
                continue
            row, error, _ = fut.result()
            if error is not None:
                self.failed[sid] = error        # sampled unmasked, then ended by the engine
                continue
            rows.append(i)
            masks.append(row)
        self._filler.num_deferred += len(self.deferred)
        self._applied = True
        if rows:
            apply_bitmask(logits, torch.cat(masks) if len(masks) > 1 else masks[0], rows)
        return logits

    def failed_rows(self) -> dict[str, str]:
        """The sequences whose mask failed (known once `apply` ran; if the executor never
        applied it, every job is waited for here so that none still reads a matcher that the
        engine is about to advance)."""
        if not self._applied:
            for sid, fut in self._futures.items():
                row, error, _ = fut.result()
                if error is not None:
                    self.failed[sid] = error
        return self.failed
