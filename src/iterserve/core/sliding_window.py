"""KV blocks of sliding-window layers: a request holds at most its window's blocks.

Why: in Gemma 2/3 and gpt-oss most layers attend only to the last W tokens (Gemma 3: 5 of
every 6 layers, W = 512 or 1024; gpt-oss: every other layer, W = 128). Their K/V older than
the window is never read again, so those layers need not keep it: vLLM's hybrid KV cache
manager frees a sliding group's blocks once they fall out of the window. The block manager's
pool (`BlockManager`, one block table per request) serves the full-attention layers; this
module gives the sliding layers a pool of their own, in the same block size, and one
"window table" per request over it:

- `table(req_id, start, n)` (every step, for the request's tokens [start, start + n)):
  returns the request's table covering positions [0, start + n) in which only the blocks
  that this step reads or writes are live: positions from `start - W + 1` (the window of the
  step's first query) to `start + n - 1`. Blocks wholly before that are returned to the
  free list first; entries for them read `0` (a real block whose finite contents the
  attention never weighs: every kernel masks keys outside the window). A request therefore
  holds at most `cdiv(W - 1 + max_tokens, block_size) + 1` blocks, whatever its length.
- `release(req_id)` when the request finishes or is preempted (recompute).

Sizing: each request's live window blocks are a subset of its full-layer table's positions,
so the pool never runs out if it has as many blocks as the full layers' pool, and never
needs more than `max_num_seqs` times the per-request cap: `num_blocks` is the smaller. Freed
blocks are reused last-in first-out, so the pool's pages that are never needed are never
touched (the KV pools are zero pages until written): the memory a sliding layer holds is its
window, not the context.

Not covered (the runner then keeps full tables for the sliding layers, as before): swap
preemption (window blocks are not swapped) and prefix caching (another request's window
blocks are not shared), and a request whose chunks can be as long as the context (no
chunked prefill: the window table would be the whole table).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_per_request(window: int, block_size: int, max_tokens_per_step: int) -> int:
    """The most window blocks one request holds: a step's keys span `window - 1` tokens
    before its first query and its `max_tokens_per_step` tokens, over one more block than
    that span fills when it does not start at a block boundary."""
    return cdiv(window - 1 + max_tokens_per_step, block_size) + 1


class SlidingWindowBlocks:
    """Window tables over a pool of `num_blocks` blocks for layers with window `window`."""

    def __init__(self, window: int, block_size: int, max_tokens_per_step: int,
                 num_blocks: int) -> None:
        if window < 1 or block_size < 1 or max_tokens_per_step < 1:
            raise ValueError(f"window {window}, block_size {block_size}, max tokens per step "
                             f"{max_tokens_per_step}: all must be at least 1")
        self.window, self.block_size, self.max_tokens_per_step = window, block_size, \
            max_tokens_per_step
        self.max_blocks_per_request = blocks_per_request(window, block_size, max_tokens_per_step)
        if num_blocks < self.max_blocks_per_request:
            raise ValueError(f"a sliding pool of {num_blocks} blocks cannot hold one request's "
                             f"window ({self.max_blocks_per_request} blocks)")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() takes the lowest id first
        self._tables: dict[str, dict[int, int]] = {}        # req -> {block index: block id}
        self.peak_blocks_per_request = 0
        self.peak_blocks_in_use = 0

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - len(self._free)

    def holds(self, req_id: str) -> bool:
        return req_id in self._tables

    def num_blocks_of(self, req_id: str) -> int:
        return len(self._tables.get(req_id, ()))

    def table(self, req_id: str, start: int, n: int) -> list[int]:
        """The window table for this step's tokens [start, start + n) (see the module
        docstring); blocks left behind by the window are freed, new ones allocated."""
        if start < 0 or n < 1:
            raise ValueError(f"tokens [{start}, {start + n}) of request {req_id!r}")
        if n > self.max_tokens_per_step:
            raise RuntimeError(f"a chunk of {n} tokens for request {req_id!r} is longer than "
                               f"the sizing allowed ({self.max_tokens_per_step})")
        bs = self.block_size
        live = self._tables.setdefault(req_id, {})
        first = max(0, start - self.window + 1) // bs       # first block the step reads
        last = (start + n - 1) // bs
        for j in [j for j in live if j < first]:
            self._free.append(live.pop(j))
        for j in range(first, last + 1):
            if j not in live:
                if not self._free:
                    raise RuntimeError(f"sliding-window pool of {self.num_blocks} blocks is "
                                       f"exhausted (a sizing bug)")
                live[j] = self._free.pop()
        if len(live) > self.max_blocks_per_request:
            raise RuntimeError(f"request {req_id!r} holds {len(live)} window blocks, more "
                               f"than {self.max_blocks_per_request}: a chunk longer than "
                               f"the sizing allowed")
        self.peak_blocks_per_request = max(self.peak_blocks_per_request, len(live))
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.blocks_in_use)
        return [live.get(j, 0) for j in range(last + 1)]

    def release(self, req_id: str) -> None:
        live = self._tables.pop(req_id, None)
        if live:
            self._free.extend(sorted(live.values(), reverse=True))

    def stats(self) -> dict:
        return {"window": self.window, "num_blocks": self.num_blocks,
                "blocks_in_use": self.blocks_in_use,
                "max_blocks_per_request": self.max_blocks_per_request,
                "peak_blocks_per_request": self.peak_blocks_per_request,
                "peak_blocks_in_use": self.peak_blocks_in_use,
                "requests": len(self._tables)}

    def consistency_violations(self) -> list[str]:
        held = [b for t in self._tables.values() for b in t.values()]
        out = []
        if len(held) != len(set(held)):
            out.append("a window block is held twice")
        if len(held) + len(self._free) != self.num_blocks or set(held) & set(self._free):
            out.append("window blocks are lost or both free and held")
        return out
