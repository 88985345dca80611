"""Which data-parallel replica serves a request: round robin, least loaded, or prefix aware.

One router is shared by the Ray Serve deployment (replicas/*, a Ray Serve request router)
and the lab's cluster simulation (lab/cluster.py), so what the lab predicts is what the
server does. Pure Python, no torch: it sees only token ids and the `ReplicaLoad` each
replica reports about itself.

Policies (`RouterPolicy` in core/config.py, the `--router` knob):

- round_robin: the next healthy replica in turn, by replica id (so the order in which the
  caller lists them does not matter); unhealthy ones are skipped, so with a fixed healthy
  set every replica's count is within one of every other's.
- least_loaded: the fewest running + waiting requests, then the lowest KV usage; exact ties
  are broken at random (seeded), so idle replicas share a burst instead of the first one
  taking it all.
- prefix_aware: the replica holding the longest prefix of the prompt's block hashes
  (the block manager's own chained hashes, `core.block_manager.block_hashes`, so the router
  and the engine's prefix cache name the same blocks), unless that replica is overloaded,
  in which case least_loaded decides. This is SGLang's cache-aware policy (approximate radix
  tree per worker, "balance" thresholds that switch to shortest-queue) written over block
  hashes instead of characters; llm-d's endpoint picker scores the same two signals.

The prefix index is approximate: the router does not ask the replicas what they cached, it
remembers what it routed to each (every full block of every prompt), in an LRU bounded by
`cache_capacity_blocks` per replica (the replica's KV pool is the natural bound: the engine
cannot have cached more than that). A lookup walks the prompt's hashes once, intersecting
the sets of replicas that hold each, so its cost is O(prompt blocks), not O(replicas x
blocks).

Thresholds of prefix_aware (module constants, chosen for engines of 8-256 sequences):
- a match must cover at least `MIN_MATCH_BLOCKS` (1) full block, else the prompt has no
  useful cache anywhere and it goes to the least loaded replica (ties: the one whose index
  is smallest, SGLang's "smallest tree", so new prefixes spread);
- the best-prefix replica is overloaded when its load (running + waiting) exceeds the least
  loaded healthy replica's by more than `max(BALANCE_ABS_MIN, BALANCE_ABS_FRAC *
  max_num_seqs)` requests AND by more than `BALANCE_REL` times (both, as SGLang's
  balance_abs / balance_rel thresholds: a small absolute gap between busy replicas is not
  worth a recompute, a large relative one on idle replicas is not worth a queue), or when
  its KV pool is at least `KV_HIGH` full with requests already waiting (it would have to
  evict or preempt to take one more).

Unhealthy replicas are never chosen; with none healthy `route` raises
`NoHealthyReplicaError`, which a server maps to 503.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from iterserve.core.block_manager import block_hashes
from iterserve.core.config import RouterPolicy
from iterserve.errors import NoHealthyReplicaError

MIN_MATCH_BLOCKS = 1        # a shorter match is no match
BALANCE_ABS_MIN = 2         # requests: the smallest absolute load gap that counts
BALANCE_ABS_FRAC = 0.25     # ... or this share of the replica's max_num_seqs, if larger
BALANCE_REL = 1.5           # and the best-prefix replica's load > this x the least load
KV_HIGH = 0.95              # KV usage at which a replica with a queue takes no more
DEFAULT_CAPACITY_BLOCKS = 1 << 16   # per-replica index bound when none is given


@dataclass
class ReplicaLoad:
    """What a replica reports about itself when a request is routed."""

    replica_id: str
    num_running: int
    num_waiting: int
    kv_usage: float           # 0..1 of its device KV blocks in use
    max_num_seqs: int
    healthy: bool = True

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting


class _PrefixIndex:
    """Block hashes routed to each replica: a per-replica LRU plus hash -> holders."""

    __slots__ = ("capacity", "lru", "holders")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.lru: dict[str, OrderedDict[int, None]] = {}
        self.holders: dict[int, set[str]] = {}

    def size(self, rid: str) -> int:
        lru = self.lru.get(rid)
        return len(lru) if lru else 0

    def longest(self, hashes: list[int], allowed: set[str]) -> tuple[int, set[str]]:
        """(blocks matched, replicas among `allowed` matching that many leading blocks)."""
        holders = self.holders
        best: set[str] = set()
        n = 0
        for h in hashes:
            hs = holders.get(h)
            if not hs:
                break
            cand = (hs & allowed) if n == 0 else (best & hs)
            if not cand:
                break
            best, n = cand, n + 1
        return n, best

    def record(self, rid: str, hashes: list[int]) -> None:
        lru = self.lru.get(rid)
        if lru is None:
            lru = self.lru[rid] = OrderedDict()
        holders = self.holders
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                hs = holders.get(h)
                if hs is None:
                    holders[h] = {rid}
                else:
                    hs.add(rid)
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            self._drop(old, rid)

    def _drop(self, h: int, rid: str) -> None:
        hs = self.holders.get(h)
        if hs is not None:
            hs.discard(rid)
            if not hs:
                del self.holders[h]

    def remove(self, rid: str) -> None:
        lru = self.lru.pop(rid, None)
        if lru:
            for h in lru:
                self._drop(h, rid)


class Router:
    """Picks a replica per request (see the module docstring for the policies)."""

    def __init__(self, policy: RouterPolicy | str, *, block_size: int,
                 cache_capacity_blocks: int | None = None, seed: int = 0):
        try:
            self.policy = RouterPolicy(policy)
        except ValueError:
            raise ValueError(f"router must be one of "
                             f"{', '.join(p.value for p in RouterPolicy)}; got {policy!r}") from None
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        cap = DEFAULT_CAPACITY_BLOCKS if cache_capacity_blocks is None else cache_capacity_blocks
        if not isinstance(cap, int) or cap < 1:
            raise ValueError(f"cache_capacity_blocks must be a positive integer, got {cap!r}")
        self.block_size = block_size
        self.cache_capacity_blocks = cap
        self._rng = random.Random(seed)
        self._rr_last: str | None = None
        self._index = _PrefixIndex(cap)
        self._lock = threading.Lock()
        # Counters (what the lab and /metrics may report).
        self.num_routed = 0
        self.num_prefix_routed = 0      # prefix_aware: sent to its best-prefix replica
        self.num_fallbacks = 0          # prefix_aware: best-prefix replica was overloaded

    # --- public ---------------------------------------------------------------------------
    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        """Index into `loads` of the replica to use; records the prompt's block hashes
        against it (prefix_aware keeps a bounded approximate index per replica)."""
        healthy = [i for i, ld in enumerate(loads) if ld.healthy]
        if not healthy:
            raise NoHealthyReplicaError(
                "no healthy replica to serve the request "
                f"({len(loads)} replica(s), all unhealthy)" if loads else
                "no replica to serve the request (none registered)")
        with self._lock:
            self.num_routed += 1
            if self.policy is RouterPolicy.ROUND_ROBIN:
                return self._round_robin(loads, healthy)
            if self.policy is RouterPolicy.LEAST_LOADED:
                return self._least_loaded(loads, healthy)
            return self._prefix_aware(prompt_token_ids, loads, healthy)

    def remove_replica(self, replica_id: str) -> None:
        """The replica died or restarted with an empty cache: forget what it held."""
        with self._lock:
            self._index.remove(replica_id)

    def cached_blocks(self, replica_id: str) -> int:
        """Blocks the index believes `replica_id` holds (tests, stats)."""
        return self._index.size(replica_id)

    # --- policies -------------------------------------------------------------------------
    def _round_robin(self, loads: Sequence[ReplicaLoad], healthy: list[int]) -> int:
        # By replica id, not position: the caller's list may come in another order each
        # call (Ray Serve's candidates do), and the turn must still go round.
        ids = sorted((loads[i].replica_id, i) for i in healthy)
        last = self._rr_last
        pick = ids[0]
        if last is not None:
            for entry in ids:
                if entry[0] > last:
                    pick = entry
                    break
        self._rr_last = pick[0]
        return pick[1]

    def _least_loaded(self, loads: Sequence[ReplicaLoad], candidates: list[int],
                      prefer_small_index: bool = False) -> int:
        best: list[int] = []
        best_key = None
        size = self._index.size
        for i in candidates:
            ld = loads[i]
            key = (ld.num_running + ld.num_waiting, ld.kv_usage)
            if prefer_small_index:
                key += (size(ld.replica_id),)
            if best_key is None or key < best_key:
                best_key, best = key, [i]
            elif key == best_key:
                best.append(i)
        return best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]

    def _prefix_aware(self, prompt: Sequence[int], loads: Sequence[ReplicaLoad],
                      healthy: list[int]) -> int:
        hashes = block_hashes(prompt, self.block_size)
        allowed = {loads[i].replica_id for i in healthy}
        n, holders = self._index.longest(hashes, allowed) if hashes else (0, set())
        if n >= MIN_MATCH_BLOCKS:
            cands = [i for i in healthy if loads[i].replica_id in holders]
            choice = self._least_loaded(loads, cands)
            if self._overloaded(loads[choice], loads, healthy):
                self.num_fallbacks += 1
                choice = self._least_loaded(loads, healthy)
            else:
                self.num_prefix_routed += 1
        else:
            choice = self._least_loaded(loads, healthy, prefer_small_index=True)
        if hashes:
            self._index.record(loads[choice].replica_id, hashes)
        return choice

    @staticmethod
    def _overloaded(ld: ReplicaLoad, loads: Sequence[ReplicaLoad], healthy: list[int]) -> bool:
        if ld.kv_usage >= KV_HIGH and ld.num_waiting > 0:
            return True
        least = min(loads[i].num_running + loads[i].num_waiting for i in healthy)
        mine = ld.num_running + ld.num_waiting
        gap = max(BALANCE_ABS_MIN, BALANCE_ABS_FRAC * ld.max_num_seqs)
        return mine - least > gap and mine > BALANCE_REL * least


__all__ = ["ReplicaLoad", "Router", "NoHealthyReplicaError", "block_hashes"]
