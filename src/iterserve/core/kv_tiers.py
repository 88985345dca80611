"""KV tiers below the device pool (host RAM, a disk directory): which block lives where.

Bookkeeping only, as the block manager is: no bytes move here. A cached block that the
device pool evicts is kept in the **RAM tier** (host slots beside the swap pool) instead of
being lost; every block the prefix cache registers is written through to the **disk tier**
(a directory that outlives the process). A prompt whose prefix is no longer on the device
then finds its next blocks in RAM (copied into fresh device blocks before this step's
forward pass) or on disk (read into RAM slots while this step computes, so the request
starts one step later with RAM hits: the read overlaps compute). The executor does the
copies and the I/O from the step's `KVTierOps` (core/scheduler_output.py), in the order
that field documents, and reports back failed reads and writes and what each copy cost
(`KVTierFeedback`).

Blocks are addressed by a **digest chain**: block i's digest is blake2b(digest i-1 || its
tokens), rooted in a key of the model file and every setting that changes the bytes of a
block (model/kv_tier_store.py builds it), so a tier written by another model or setting
is never read. Unlike the device cache's Python hash chain, this one is the same in
every process and on every restart, and as strong as the hash.

Eviction is least recently used within a bound: slots for RAM, blocks (each one file of a
fixed size) for disk. A slot or file read or written in the current step is pinned until
`end_step`, so a copy the executor has not made yet can never be overwritten by a later
decision of the same step; a read whose slot is reused later is the executor's to order
(it waits for a slot's pending read before touching the slot again).

Whether a tier is read back at all is decided by measured cost (`TransferCosts`): a block
is loaded only while loading it measured cheaper than recomputing its tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from iterserve.core.scheduler_output import KVTierFeedback, KVTierOps

DIGEST_BYTES = 32
RAM, DISK = "ram", "disk"


def root_digest(setting_key: str) -> str:
    """The digest every chain starts from: a tier's identity (model file, dtypes, sizes)."""
    return hashlib.blake2b(setting_key.encode(), digest_size=DIGEST_BYTES).hexdigest()


def chain_digest(parent: str, tokens) -> str:
    """Digest of one full block: its parent's digest and its token ids (int32)."""
    h = hashlib.blake2b(bytes.fromhex(parent), digest_size=DIGEST_BYTES)
    h.update(array("i", tokens).tobytes())
    return h.hexdigest()


def block_digests(token_ids, block_size: int, root: str) -> list[str]:
    """The digest of each full block of `token_ids` (what the block manager memoises)."""
    out: list[str] = []
    parent = root
    tokens = list(token_ids)
    for i in range(len(tokens) // block_size):
        parent = chain_digest(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What a waiting request finds of its prompt before computing anything.

    `blocks`: device blocks it shares now; `ram_slots`: the next blocks, in RAM tier slots,
    copied into fresh device blocks at admission; `promoting`: the blocks after those are
    being read from disk into RAM this step, so the request is better admitted next step.
    """

    blocks: tuple[int, ...] = ()
    ram_slots: tuple[int, ...] = ()
    promoting: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.ram_slots)


NO_HIT = PrefixHit()


class TransferCosts:
    """Seconds per block to load from each tier and to recompute, as measured (EWMA).

    The executor reports what its copies and reads took and what prefill-heavy forward
    passes cost per token; until it has, priors stand in (RAM at 10 GB/s, disk at 1 GB/s
    plus a file open, recompute at 1 ms a token: CPU-like figures, which load). A tier is
    read back only while `worth_loading` says its measured cost per block is below the
    cost of recomputing a block: on a GPU that recomputes a block in less time than the
    disk takes to return it, the disk tier is written but not read."""

    ALPHA = 0.2
    MIN_COMPUTE_TOKENS = 32      # a step this small costs per token what decodes cost

    def __init__(self, bytes_per_block: int, block_size: int) -> None:
        self.block_size = block_size
        self.load_s = {RAM: bytes_per_block / 10e9, DISK: bytes_per_block / 1e9 + 1e-4}
        self.compute_s_per_token = 1e-3
        self.measured = {RAM: 0, DISK: 0, "compute": 0}

    def _ewma(self, old: float, new: float, what: str) -> float:
        first = not self.measured[what]
        self.measured[what] += 1
        return new if first else old + self.ALPHA * (new - old)

    def observe_load(self, tier: str, seconds: float, blocks: int) -> None:
        if blocks > 0 and seconds >= 0:
            self.load_s[tier] = self._ewma(self.load_s[tier], seconds / blocks, tier)

    def observe_compute(self, seconds: float, tokens: int) -> None:
        if tokens >= self.MIN_COMPUTE_TOKENS and seconds > 0:
            self.compute_s_per_token = self._ewma(self.compute_s_per_token, seconds / tokens,
                                                  "compute")

    def recompute_s(self) -> float:
        """What recomputing one block costs (its tokens through a prefill step)."""
        return self.compute_s_per_token * self.block_size

    def worth_loading(self, tier: str) -> bool:
        return self.load_s[tier] < self.recompute_s()

    def stats(self) -> dict:
        return {"ram_load_ms_per_block": round(self.load_s[RAM] * 1e3, 4),
                "disk_load_ms_per_block": round(self.load_s[DISK] * 1e3, 4),
                "recompute_ms_per_block": round(self.recompute_s() * 1e3, 4),
                "measured": dict(self.measured),
                "loads_ram": self.worth_loading(RAM), "loads_disk": self.worth_loading(DISK)}


class _Lru:
    """Digests in least-recently-used order with the pins of the current step."""

    def __init__(self) -> None:
        self.order: OrderedDict[str, int] = OrderedDict()    # digest -> value (slot / 0)
        self.pinned: set[str] = set()

    def __contains__(self, digest: str) -> bool:
        return digest in self.order

    def __len__(self) -> int:
        return len(self.order)

    def touch(self, digest: str) -> None:
        self.order.move_to_end(digest)

    def victim(self) -> str | None:
        """The least recently used digest that is not pinned (None: all are)."""
        for d in self.order:
            if d not in self.pinned:
                return d
        return None


class RamTier:
    """Host slots [first_slot, first_slot + num_slots) of the executor's host pool, each
    holding one block's K/V for a digest."""

    def __init__(self, first_slot: int, num_slots: int) -> None:
        self.first_slot, self.num_slots = first_slot, num_slots
        self._lru = _Lru()
        self._slot_digest: dict[int, str] = {}
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, digest: str) -> int | None:
        return self._lru.order.get(digest)

    def digest_of(self, slot: int) -> str | None:
        return self._slot_digest.get(slot)

    def pin(self, digest: str) -> None:
        self._lru.pinned.add(digest)
        self._lru.touch(digest)

    @property
    def num_unpinned(self) -> int:
        return self.num_slots - len(self._lru.pinned)

    def take(self, digest: str) -> int | None:
        """A pinned slot for `digest` (evicting the least recently used unpinned one when
        none is free), or None when every slot is pinned this step."""
        if self._free:
            slot = self._free.pop()
        else:
            old = self._lru.victim()
            if old is None:
                return None
            slot = self._lru.order.pop(old)
            del self._slot_digest[slot]
            self.num_evicted += 1
        self._lru.order[digest] = slot
        self._slot_digest[slot] = digest
        self._lru.pinned.add(digest)
        return slot

    def forget(self, digest: str) -> None:
        slot = self._lru.order.pop(digest, None)
        if slot is not None:
            del self._slot_digest[slot]
            self._lru.pinned.discard(digest)
            self._free.append(slot)

    def end_step(self) -> None:
        self._lru.pinned.clear()

    def violations(self) -> list[str]:
        bad = []
        slots = sorted(self._lru.order.values())
        if len(set(slots)) != len(slots):
            bad.append("RAM tier: a slot holds two digests")
        if sorted(slots + self._free) != list(range(self.first_slot,
                                                    self.first_slot + self.num_slots)):
            bad.append("RAM tier: slots are lost or both used and free")
        if any(self._slot_digest.get(s) != d for d, s in self._lru.order.items()):
            bad.append("RAM tier: the slot -> digest map disagrees with the index")
        return bad


class DiskTier:
    """Which digests have a block file, bounded by `capacity` blocks (the files are all one
    size). `probe` (the store's: does a file exist?) finds blocks that another process
    sharing the directory wrote since this one scanned it. Evicted digests wait in
    `pending_deletes` for the step's ops (the executor deletes their files)."""

    def __init__(self, capacity: int, probe: Callable[[str], bool] | None = None) -> None:
        self.capacity = capacity
        self.probe = probe
        self._lru = _Lru()
        # Evicted digests whose files the next ops delete (ordered; a digest added again
        # before then is taken out: its file stays).
        self.pending_deletes: dict[str, None] = {}
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, digest: str) -> bool:
        return digest in self._lru

    def contains(self, digest: str) -> bool:
        """In the index, or (probed) written by another process since."""
        if digest in self._lru:
            return True
        if self.probe is not None and self.probe(digest):
            self.add(digest)
            return True
        return False

    def add(self, digest: str) -> None:
        """Index `digest` as the most recently used, evicting the least recently used
        unpinned ones beyond the bound."""
        lru = self._lru
        if digest in lru:
            lru.touch(digest)
            return
        lru.order[digest] = 0
        self.pending_deletes.pop(digest, None)
        self._trim(keep=digest)

    def _trim(self, keep: str | None = None) -> None:
        lru = self._lru
        while len(lru) > self.capacity:
            old = lru.victim()
            if old is None or old == keep:
                break                   # (over the bound until the pins go: end_step)
            del lru.order[old]
            self.pending_deletes[old] = None
            self.num_evicted += 1

    def pin(self, digest: str) -> None:
        self._lru.pinned.add(digest)
        self._lru.touch(digest)

    def touch(self, digest: str) -> None:
        self._lru.touch(digest)

    def forget(self, digest: str) -> None:
        self._lru.order.pop(digest, None)
        self._lru.pinned.discard(digest)

    def end_step(self) -> None:
        self._lru.pinned.clear()
        self._trim()                    # (its deletes go with the next step's ops)


class KVTiers:
    """The RAM and disk tiers of one block manager, their pending ops and their counters.

    The block manager calls it at four points: a cached block is evicted (`on_evict`:
    keep it in RAM), registered (`on_register`: write it through to disk), looked up at
    admission (`find`: RAM slots in a row, then a disk run promoted into RAM) and claimed
    (`load`: copy a RAM slot into a fresh device block). `end_step` hands the step's ops to
    the scheduler's output; `apply_feedback` takes the executor's report back.
    """

    def __init__(self, *, block_size: int, ram_first_slot: int, ram_slots: int,
                 disk_blocks: int, bytes_per_block: int = 0) -> None:
        self.block_size = block_size
        self.ram = RamTier(ram_first_slot, ram_slots) if ram_slots else None
        self.disk = DiskTier(disk_blocks) if disk_blocks else None
        self.costs = TransferCosts(bytes_per_block or block_size * 4096, block_size)
        self.root = root_digest("")
        self._ops = KVTierOps()
        self._req_digests: dict[str, list[str]] = {}
        self._promoted: set[str] = set()        # requests that had one disk promotion
        self.counters = {"ram_hits": 0, "ram_saves": 0, "disk_hits": 0, "disk_writes": 0,
                         "disk_deletes": 0, "failed_reads": 0, "failed_writes": 0,
                         "invalid_blocks": 0}

    # --- wiring ---------------------------------------------------------------------------
    def connect_disk(self, setting_key: str, digests_oldest_first: Iterable[str] = (),
                     probe: Callable[[str], bool] | None = None) -> None:
        """Root the chains in the store's setting key and index the block files it found
        (oldest first, so the bound evicts the oldest); `probe` finds later files of other
        processes. Call before the first request."""
        if self._req_digests:
            raise RuntimeError("connect_disk after requests were hashed")
        self.root = root_digest(setting_key)
        if self.disk is not None:
            self.disk.probe = probe
            for d in digests_oldest_first:
                self.disk.add(d)

    def set_bytes_per_block(self, nbytes: int) -> None:
        self.costs = TransferCosts(nbytes, self.block_size)

    # --- digests --------------------------------------------------------------------------
    def digests_for(self, rid: str, token_ids: list[int], num_blocks: int) -> list[str]:
        """The first `num_blocks` digests of a request, memoised (its tokens only grow)."""
        ds = self._req_digests.get(rid)
        if ds is None:
            ds = self._req_digests[rid] = []
        bs = self.block_size
        while len(ds) < num_blocks:
            i = len(ds)
            ds.append(chain_digest(ds[-1] if ds else self.root, token_ids[i * bs:(i + 1) * bs]))
        return ds

    def forget_request(self, rid: str) -> None:
        self._req_digests.pop(rid, None)
        self._promoted.discard(rid)

    # --- the four hooks -------------------------------------------------------------------
    def on_evict(self, block: int, digest: str) -> None:
        """The device pool evicts cached `block`: keep a copy in RAM (unless it has one)."""
        ram = self.ram
        if ram is None:
            return
        if ram.lookup(digest) is not None:
            ram.pin(digest)              # (a load from that slot may be pending this step)
            return
        slot = ram.take(digest)
        if slot is not None:
            self._ops.ram_saves.append((block, slot))
            self.counters["ram_saves"] += 1

    def on_register(self, block: int, digest: str) -> None:
        """`block` was just computed and cached: write it through to disk."""
        disk = self.disk
        if disk is None:
            return
        if digest in disk:
            disk.touch(digest)
            return
        disk.add(digest)    # (an eviction of it this same step is a delete queued after it)
        self._ops.disk_saves.append((block, digest))
        self.counters["disk_writes"] += 1

    def find(self, rid: str, digests: list[str], start: int) -> tuple[list[int], bool]:
        """RAM slots of digests[start:] in a row, and whether the disk run after them is
        promoted into RAM this step (once per request; only as far as RAM has unpinned
        slots, and only while each tier measured cheaper than recomputing)."""
        slots: list[int] = []
        i, n = start, len(digests)
        ram, costs = self.ram, self.costs
        if ram is None:
            return slots, False
        if costs.worth_loading(RAM):
            while i < n:
                s = ram.lookup(digests[i])
                if s is None:
                    break
                slots.append(s)
                i += 1
        disk = self.disk
        if disk is None or i >= n or rid in self._promoted or not costs.worth_loading(DISK) \
                or not costs.worth_loading(RAM):
            return slots, False
        room = ram.num_unpinned - len(slots)      # (the hits above get pinned on admission)
        run = []
        while i < n and len(run) < room and disk.contains(digests[i]):
            run.append(digests[i])
            i += 1
        if not run:
            return slots, False
        self._promoted.add(rid)
        for s in slots:                          # keep the hits found above out of reach
            ram.pin(ram.digest_of(s))
        for d in run:
            if ram.lookup(d) is not None:        # (a later block may still be in RAM)
                ram.pin(d)
                continue
            slot = ram.take(d)
            if slot is None:                     # (room counted the pins: not expected)
                break
            disk.pin(d)
            self._ops.disk_reads.append((d, slot))
        self.counters["disk_hits"] += len(run)
        return slots, True

    def claim(self, slots: Iterable[int]) -> None:
        """Pin RAM hits before fresh blocks are taken for them (a spill must not evict
        the slots this admission loads from)."""
        ram = self.ram
        for s in slots:
            ram.pin(ram.digest_of(s))

    def load(self, slot: int, block: int) -> None:
        """Copy RAM `slot` into fresh device `block` before this step's forward pass."""
        self._ops.ram_loads.append((slot, block))
        self.counters["ram_hits"] += 1

    # --- step boundary --------------------------------------------------------------------
    @property
    def has_pending_ops(self) -> bool:
        return bool(self._ops or (self.disk is not None and self.disk.pending_deletes))

    def end_step(self) -> KVTierOps | None:
        """The step's ops for the executor (None when there are none); pins are lifted."""
        disk = self.disk
        if disk is not None:
            if disk.pending_deletes:
                self._ops.disk_deletes.extend(disk.pending_deletes)
                self.counters["disk_deletes"] += len(disk.pending_deletes)
                disk.pending_deletes = {}
            disk.end_step()          # (deletes beyond the bound it finds: the next step's)
        if self.ram is not None:
            self.ram.end_step()
        ops, self._ops = (self._ops, KVTierOps()) if self._ops else (None, self._ops)
        return ops

    def apply_feedback(self, fb: KVTierFeedback) -> list[int]:
        """Forget what the executor found missing or corrupt; take its measured costs.
        Returns the device blocks whose data a failed load left wrong (the block manager
        uncaches them)."""
        ram, disk = self.ram, self.disk
        for digest, slot in fb.failed_reads:
            self.counters["failed_reads"] += 1
            if disk is not None:
                disk.forget(digest)
            if ram is not None and ram.digest_of(slot) == digest:
                ram.forget(digest)
        for digest in fb.failed_writes:
            self.counters["failed_writes"] += 1
            if disk is not None:
                disk.forget(digest)
        for tier, (seconds, blocks) in fb.load_s.items():
            self.costs.observe_load(tier, seconds, blocks)
        if fb.compute_tokens:
            self.costs.observe_compute(fb.compute_s, fb.compute_tokens)
        self.counters["invalid_blocks"] += len(fb.invalid_blocks)
        return list(fb.invalid_blocks)

    # --- reports --------------------------------------------------------------------------
    def stats(self) -> dict:
        out: dict = {"counters": dict(self.counters), "costs": self.costs.stats()}
        if self.ram is not None:
            out["ram"] = {"slots": self.ram.num_slots, "used": len(self.ram),
                          "evicted": self.ram.num_evicted}
        if self.disk is not None:
            out["disk"] = {"capacity_blocks": self.disk.capacity, "used": len(self.disk),
                           "evicted": self.disk.num_evicted}
        return out

    def violations(self) -> list[str]:
        bad = self.ram.violations() if self.ram is not None else []
        if self.disk is not None and len(self.disk) > self.disk.capacity:
            bad.append(f"disk tier: {len(self.disk)} blocks indexed, bound "
                       f"{self.disk.capacity}")
        return bad
