"""Paged KV-cache bookkeeping: a fixed pool of blocks, ref counts, a prefix cache, a swap pool.

No tensors live here. A block is an index into the executor's KV tensors; this module only
decides which request owns which block. Each request has a block table (list of block ids,
position i holds tokens [i*block_size, (i+1)*block_size)). The tables are this module's
own: the scheduler never reads them. It sees an allocation's result as a `KVCacheBlocks`
value (vLLM v1's idea: the blocks it added, or None when they do not fit) and passes those
ids on to the executors as data, so nothing is aliased and nothing is copied per decode step
that needs no new block.

Prefix caching (vLLM's "automatic prefix caching"): once a block is full of computed tokens
it is registered under a key `(parent block hash, its tokens)`; the hash of that key is the
parent of the next block, so a key names the whole prefix up to it. A new request looks up
the keys of its prompt's full blocks and shares every leading block found (ref count + 1).
A freed block that is registered stays in an LRU list of evictable blocks: it counts as
free, is handed out again when a request hits it, and is evicted (its key forgotten) only
when a fresh block is needed and no never-cached free block is left. Because the key holds
the tokens themselves, a hit is checked for equality, not just for a matching hash.

Swap space is a second pool of `num_swap_blocks` host blocks. Swapping out copies a
request's computed blocks to host blocks and frees the device blocks; swapping in does the
reverse. The copies themselves are the executor's job: these methods return the
(source, destination) pairs.

KV tiers (core/kv_tiers.py, with `num_ram_tier_blocks` / `num_disk_tier_blocks`): an
evicted cached block is kept in host RAM slots that follow the swap pool's, every newly
cached block is written through to a disk directory, and admission looks past the device
cache into both (`find_prefix_hit`). This module only calls the tiers at those points and
hands their ops to the scheduler's output at `end_step`; which digest is in which tier is
theirs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from iterserve.core.kv_tiers import NO_HIT, KVTiers, PrefixHit
from iterserve.core.request import Request
from iterserve.core.scheduler_output import KVTierFeedback, KVTierOps
from iterserve.errors import NoFreeBlocksError

BlockKey = tuple  # (parent hash or None, tuple of block_size token ids)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hashes(token_ids, block_size: int) -> list[int]:
    """The chained hash of each full block of `token_ids`: entry i is `hash(key_i)` with
    key_i = (entry i-1 or None, the block's tokens), exactly the parent hash the prefix
    cache chains its keys with (`BlockManager._keys_for`), so a router that hashes a prompt
    this way names the same prefixes as the engine's cache. Ints and tuples of ints hash
    the same in every process (no PYTHONHASHSEED salt), so replicas and router agree."""
    out: list[int] = []
    parent = None
    tokens = tuple(token_ids)
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tokens[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """The block manager's answer to the scheduler: block ids, as an immutable value.

    From `allocate_slots`, the blocks the allocation appended to the request's table (empty
    on the common decode step whose last block still has room); from `get_blocks`, the whole
    table. Always truthy, so `if not bm.allocate_slots(...)` reads "did not fit" (None).
    """

    block_ids: tuple[int, ...] = ()


NO_NEW_BLOCKS = KVCacheBlocks()


class BlockManager:
    """Owns the device and host block pools; the scheduler's only view of the KV cache."""

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0,
                 enable_prefix_caching: bool = False, num_ram_tier_blocks: int = 0,
                 num_disk_tier_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1 or num_swap_blocks < 0 \
                or num_ram_tier_blocks < 0 or num_disk_tier_blocks < 0:
            raise ValueError(
                f"invalid pool: num_blocks={num_blocks}, block_size={block_size}, "
                f"num_swap_blocks={num_swap_blocks}, num_ram_tier_blocks="
                f"{num_ram_tier_blocks}, num_disk_tier_blocks={num_disk_tier_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_swap_blocks = num_swap_blocks
        self.enable_prefix_caching = enable_prefix_caching

        self.ref_cnt = [0] * num_blocks
        # Free blocks that hold no cached prefix (handed out first, LIFO for locality).
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks that hold a cached prefix, least recently freed first (evicted first).
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # Prefix cache: key -> block id, and the reverse for registered blocks.
        self._cached: dict[BlockKey, int] = {}
        self._block_key: dict[int, BlockKey] = {}

        self.tables: dict[str, list[int]] = {}          # request id -> device block table
        self._req_keys: dict[str, list[BlockKey]] = {}  # request id -> keys of its full blocks
        self._num_registered: dict[str, int] = {}       # leading table blocks already cached

        self._free_host: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.host_tables: dict[str, list[int]] = {}     # request id -> host block table
        self._host_release: list[int] = []              # freed at end_step() (see swap_in)

        self.num_cache_hits = 0       # blocks served from the prefix cache (lifetime)
        self.num_cache_queries = 0    # blocks looked up (lifetime)

        # Tiers below the pool (tiers of the prefix cache, so only with it). The RAM tier's
        # slots follow the swap pool's in the executor's host pool.
        self.tiers: KVTiers | None = None
        if enable_prefix_caching and (num_ram_tier_blocks or num_disk_tier_blocks):
            self.tiers = KVTiers(block_size=block_size, ram_first_slot=num_swap_blocks,
                                 ram_slots=num_ram_tier_blocks, disk_blocks=num_disk_tier_blocks)
        self._block_digest: dict[int, str] = {}          # registered block -> tier digest
        self._loading: set[str] = set()                  # requests with RAM loads this step

    # --- queries --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (evictable cached blocks count as free)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host)

    @property
    def usage(self) -> float:
        """Fraction of the device pool held by requests (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (in use or evictable)."""
        return len(self._cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's device table (tests, checks)."""
        return list(self.tables.get(request_id, ()))

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's whole device table as a value (a swapped-in request's new table)."""
        return KVCacheBlocks(tuple(self.tables.get(request_id, ())))

    def holds_device_blocks(self, request_id: str) -> bool:
        return request_id in self.tables

    def num_device_blocks(self, request_id: str) -> int:
        return len(self.tables.get(request_id, ()))

    def num_host_blocks(self, request_id: str) -> int | None:
        """Host blocks of a swapped-out request (None: it has no host table)."""
        host = self.host_tables.get(request_id)
        return None if host is None else len(host)

    def device_owners(self) -> set[str]:
        """Ids of the requests holding device blocks (consistency checks)."""
        return set(self.tables)

    def can_allocate(self, request: Request, num_new_tokens: int,
                     cached_blocks: list[int] | tuple | PrefixHit = ()) -> bool:
        """Whether `num_new_tokens` more tokens (after `cached_blocks` hits) fit now."""
        if isinstance(cached_blocks, PrefixHit):
            return self._blocks_needed(request, num_new_tokens, cached_blocks.blocks,
                                       len(cached_blocks.ram_slots)) >= 0
        return self._blocks_needed(request, num_new_tokens, cached_blocks) >= 0

    def _blocks_needed(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[int] | tuple, num_ram_hits: int = 0) -> int:
        """Free blocks left after such an allocation (negative: it does not fit). RAM tier
        hits each take a fresh block."""
        table = self.tables.get(request.request_id)
        have = len(table) if table else 0
        total = request.num_computed_tokens + (len(cached_blocks) + num_ram_hits) \
            * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - have - len(cached_blocks)
        ref = self.ref_cnt
        # Hitting an evictable cached block takes it out of the free pool too.
        touched = sum(1 for b in cached_blocks if ref[b] == 0)
        return self.num_free_blocks - max(need, 0) - touched

    # --- prefix cache ---------------------------------------------------------------------
    def _keys_for(self, request: Request, num_full_blocks: int) -> list[BlockKey]:
        """Keys of the request's first `num_full_blocks` blocks, computed once and memoised."""
        rid = request.request_id
        keys = self._req_keys.get(rid)
        if keys is None:
            keys = self._req_keys[rid] = []
        bs = self.block_size
        tokens = request.all_token_ids
        while len(keys) < num_full_blocks:
            i = len(keys)
            parent = hash(keys[-1]) if keys else None
            keys.append((parent, tuple(tokens[i * bs:(i + 1) * bs])))
        return keys

    def find_cached_blocks(self, request: Request) -> list[int]:
        """The leading blocks of `request` found in the prefix cache (not yet claimed).

        At most num_tokens - 1 tokens are served from the cache: the last token is always
        computed so the executor has logits to sample from.
        """
        max_blocks = self._max_hit_blocks(request)
        if max_blocks <= 0:
            return []
        keys = self._keys_for(request, max_blocks)
        cached = self._cached
        hits: list[int] = []
        for i in range(max_blocks):
            block = cached.get(keys[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def _max_hit_blocks(self, request: Request) -> int:
        """How many leading blocks a cache may serve: 0 without prefix caching, for a
        prompt that needs its prompt logprobs (cached blocks have no logits: as vLLM) or
        for a pooling request whose pooler reads every row's hidden state."""
        if not self.enable_prefix_caching:
            return 0
        if request.sampling_params.prompt_logprobs is not None and not request.output_token_ids:
            return 0
        pp = request.pooling_params
        if pp is not None and pp.reads_every_row:    # mean / CLS pooling: every row computed
            return 0
        return (request.num_tokens - 1) // self.block_size

    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """Admission's lookup: the device hits (`find_cached_blocks`), then, with KV tiers,
        the blocks after them found in RAM, and whether a disk run after those is being
        read into RAM this step (then the request is better admitted next step)."""
        blocks = self.find_cached_blocks(request)
        tiers = self.tiers
        if tiers is None:
            return PrefixHit(tuple(blocks)) if blocks else NO_HIT
        max_blocks = self._max_hit_blocks(request)
        if len(blocks) >= max_blocks:
            return PrefixHit(tuple(blocks))
        digests = tiers.digests_for(request.request_id, request.all_token_ids, max_blocks)
        slots, promoting = tiers.find(request.request_id, digests, len(blocks))
        return PrefixHit(tuple(blocks), tuple(slots), promoting)

    def cache_full_blocks(self, request: Request, write_through: bool = True) -> None:
        """Register the request's blocks that are now full of computed tokens (and, with a
        disk tier, write them through; not for blocks whose data a copy of this very step
        brings: `write_through=False`, the swap-in's)."""
        rid = request.request_id
        table = self.tables.get(rid)
        if table is None:
            return
        full = min(request.num_computed_tokens // self.block_size, len(table))
        done = self._num_registered.get(rid, 0)
        if full <= done:
            return
        keys = self._keys_for(request, full)
        cached, block_key = self._cached, self._block_key
        tiers = self.tiers
        digests = tiers.digests_for(rid, request.all_token_ids, full) if tiers else None
        for i in range(done, full):
            key = keys[i]
            block = table[i]
            if key not in cached and block not in block_key:
                cached[key] = block
                block_key[block] = key
                if digests is not None:
                    self._block_digest[block] = digests[i]
                    if write_through:
                        tiers.on_register(block, digests[i])
            # else: the same prefix is already cached in another block; this one stays
            # private and goes back to the plain free list when released.
        self._num_registered[rid] = full

    # --- allocation -----------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if self._free_plain:
            block = self._free_plain.pop()
        elif self._free_cached:
            block, _ = self._free_cached.popitem(last=False)   # evict the LRU cached block
            key = self._block_key.pop(block)
            del self._cached[key]
            if self.tiers is not None:
                digest = self._block_digest.pop(block, None)
                if digest is not None:
                    self.tiers.on_evict(block, digest)       # kept in RAM, not lost
        else:
            raise NoFreeBlocksError("no free KV block (allocation without a fit check)")
        self.ref_cnt[block] = 1
        return block

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[int] | tuple | PrefixHit = ()
                       ) -> KVCacheBlocks | None:
        """Give `request` blocks for `num_new_tokens` more tokens: the blocks added (possibly
        none), or None (and no change) if they do not fit. `cached_blocks` are prefix-cache
        hits claimed first (admission only: the caller then advances num_computed_tokens by
        that many blocks' tokens); they are part of the returned blocks. A `PrefixHit` adds
        RAM tier hits: each gets a fresh block, loaded from its slot before this step's
        forward pass and cached at once (so later admissions of the step share it)."""
        ram: tuple[int, ...] = ()
        if isinstance(cached_blocks, PrefixHit):
            cached_blocks, ram = cached_blocks.blocks, cached_blocks.ram_slots
        rid = request.request_id
        table = self.tables.get(rid)
        bs = self.block_size
        if table is not None and not cached_blocks and not ram:
            # Hot path (decode): usually the last block still has room (cdiv inlined).
            need = -(-(request.num_computed_tokens + num_new_tokens) // bs) - len(table)
            if need <= 0:
                return NO_NEW_BLOCKS
            if need > len(self._free_plain) + len(self._free_cached):
                return None
            have = len(table)
        else:
            if self._blocks_needed(request, num_new_tokens, cached_blocks, len(ram)) < 0:
                return None
            if table is None:
                table = self.tables[rid] = []
            have = len(table)
            ref = self.ref_cnt
            free_cached = self._free_cached
            for block in cached_blocks:
                if ref[block] == 0:
                    del free_cached[block]
                ref[block] += 1
                table.append(block)
            if ram:
                self._load_ram_hits(request, table, ram)
            if cached_blocks or ram:
                self._num_registered[rid] = len(table)
                self.num_cache_hits += len(cached_blocks) + len(ram)
            hit_tokens = (len(table) - have) * bs         # device and RAM hits
            need = cdiv(request.num_computed_tokens + hit_tokens + num_new_tokens, bs) \
                - len(table)
        for _ in range(need):
            table.append(self._take_free_block())
        return KVCacheBlocks(tuple(table[have:])) if len(table) > have else NO_NEW_BLOCKS

    def _load_ram_hits(self, request: Request, table: list[int], slots: tuple[int, ...]) -> None:
        """Append a fresh block per RAM hit, each loaded from its slot and cached under its
        key (unless another block holds that prefix already: then it stays private)."""
        tiers = self.tiers
        tiers.claim(slots)
        n = len(table) + len(slots)
        keys = self._keys_for(request, n)
        digests = tiers.digests_for(request.request_id, request.all_token_ids, n)
        cached, block_key = self._cached, self._block_key
        for slot in slots:
            i = len(table)
            block = self._take_free_block()
            table.append(block)
            tiers.load(slot, block)
            if keys[i] not in cached:
                cached[keys[i]] = block
                block_key[block] = keys[i]
                self._block_digest[block] = digests[i]
        self._loading.add(request.request_id)

    @property
    def loading_request_ids(self) -> set[str]:
        """Requests admitted this step with RAM tier loads (their blocks are written before
        the forward pass, after any swap-out: so they must not be swapped out this step)."""
        return self._loading

    def trim(self, request: Request, num_tokens: int) -> int:
        """Return the blocks past the first `num_tokens` slots of the request's table (the
        slots of rejected speculative tokens); the number of blocks freed. Blocks that hold
        computed tokens are never trimmed (num_tokens below them is a bug)."""
        table = self.tables.get(request.request_id)
        if table is None:
            return 0
        keep = cdiv(num_tokens, self.block_size)
        if keep < self._num_registered.get(request.request_id, 0):
            raise ValueError(f"{request.request_id}: cannot trim to {num_tokens} tokens, "
                             "below its cached blocks")
        extra = len(table) - keep
        if extra <= 0:
            return 0
        self._release(table[keep:])
        del table[keep:]
        return extra

    def note_cache_query(self, request: Request) -> None:
        """Count the blocks a first admission looked up (for the prefix-cache hit rate)."""
        if self.enable_prefix_caching:
            self.num_cache_queries += (request.num_tokens - 1) // self.block_size

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each block, tail first, so that when they become evictable
        the end of a sequence is evicted before its (more shareable) beginning."""
        ref = self.ref_cnt
        block_key = self._block_key
        for block in reversed(blocks):
            ref[block] -= 1
            if ref[block] == 0:
                if block in block_key:
                    self._free_cached[block] = None
                else:
                    self._free_plain.append(block)

    def free(self, request: Request) -> None:
        """Release everything `request` holds (device and host blocks). Idempotent."""
        rid = request.request_id
        table = self.tables.pop(rid, None)
        if table:
            self._release(table)
        host = self.host_tables.pop(rid, None)
        if host:
            self._free_host.extend(reversed(host))
        self._req_keys.pop(rid, None)
        self._num_registered.pop(rid, None)
        if self.tiers is not None:
            self.tiers.forget_request(rid)

    def free_device(self, request: Request) -> None:
        """Release the device blocks only (preemption by recompute); keeps memoised keys so a
        re-admission can find its own blocks in the prefix cache."""
        rid = request.request_id
        table = self.tables.pop(rid, None)
        if table:
            self._release(table)
        self._num_registered.pop(rid, None)

    # --- swap -----------------------------------------------------------------------------
    def num_swap_out_blocks(self, request: Request) -> int:
        return cdiv(request.num_computed_tokens, self.block_size)

    def can_swap_out(self, request: Request) -> bool:
        return self.num_swap_out_blocks(request) <= len(self._free_host)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's computed blocks to host blocks; returns (device, host) copies.

        Blocks beyond the computed tokens (allocated for work not done) are just freed.
        """
        rid = request.request_id
        table = self.tables.pop(rid, [])
        n = self.num_swap_out_blocks(request)
        if n > len(self._free_host):
            self.tables[rid] = table
            raise NoFreeBlocksError(f"swap space full: {rid} needs {n} host blocks")
        host = [self._free_host.pop() for _ in range(n)]
        self.host_tables[rid] = host
        mapping = list(zip(table[:n], host))
        self._release(table)
        self._num_registered.pop(rid, None)
        return mapping

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        host = self.host_tables.get(request.request_id, ())
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(need, len(host)) <= self.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring the request's blocks back to fresh device blocks; returns (host, device)
        copies. The host blocks are released only at end_step(), so that a swap-out later in
        the same step cannot reuse (and overwrite) one before this copy has been made."""
        rid = request.request_id
        host = self.host_tables.pop(rid)
        if len(host) > self.num_free_blocks:
            self.host_tables[rid] = host
            raise NoFreeBlocksError(f"no room to swap in {rid}")
        table = self.tables[rid] = [self._take_free_block() for _ in host]
        self._host_release.extend(host)
        # The fresh blocks are registered again (where their prefix is not cached elsewhere).
        self._num_registered[rid] = 0
        self.cache_full_blocks(request, write_through=False)   # (their data comes later)
        return list(zip(host, table))

    def end_step(self) -> KVTierOps | None:
        """The step is scheduled: swap slots freed by swap-ins return, and the tiers' ops
        of the step (None when there are none) go to its output."""
        if self._host_release:
            self._free_host.extend(reversed(self._host_release))
            self._host_release.clear()
        if self.tiers is None:
            return None
        self._loading.clear()
        return self.tiers.end_step()

    # --- tiers ----------------------------------------------------------------------------
    @property
    def has_pending_kv_ops(self) -> bool:
        """Tier ops (write-through saves, deletes) wait for the next step's output."""
        return self.tiers is not None and self.tiers.has_pending_ops

    def apply_tier_feedback(self, feedback: KVTierFeedback) -> None:
        """The executor's report on the last step's tier ops: forget what it found missing
        or corrupt, uncache device blocks a failed load left wrong, learn the costs."""
        if self.tiers is None:
            return
        for block in self.tiers.apply_feedback(feedback):
            key = self._block_key.pop(block, None)
            self._block_digest.pop(block, None)
            if key is None:
                continue
            del self._cached[key]
            if block in self._free_cached:
                del self._free_cached[block]
                self._free_plain.append(block)

    def tier_stats(self) -> dict | None:
        return None if self.tiers is None else self.tiers.stats()

    # --- checks ---------------------------------------------------------------------------
    def consistency_violations(self) -> list[tuple[str | None, str]]:
        """Every way the books do not balance, as (request id or None, message).

        Each block's ref count equals the number of tables holding it; no table holds a block
        twice or a block outside the pool; a block shared by several tables is a registered
        prefix block; a block is in exactly one of {in use, free plain, free cached}; host
        blocks are owned at most once. O(blocks + table entries).
        """
        bad: list[tuple[str | None, str]] = []
        n = self.num_blocks
        owners = [0] * n
        holders: dict[int, list[str]] = {}
        for rid, table in self.tables.items():
            if len(set(table)) != len(table):
                bad.append((rid, f"holds a block twice: {table}"))
            for b in table:
                if not (isinstance(b, int) and 0 <= b < n):
                    bad.append((rid, f"block table names block {b!r}, outside the pool of {n}"))
                    continue
                owners[b] += 1
                holders.setdefault(b, []).append(rid)
        plain = set(self._free_plain)
        if len(plain) != len(self._free_plain):
            bad.append((None, "a block is twice in the free list"))
        ref, block_key, free_cached = self.ref_cnt, self._block_key, self._free_cached
        for b in range(n):
            rids = holders.get(b) or [None]
            if ref[b] != owners[b]:
                bad += [(rid, f"block {b}: ref count {ref[b]} but {owners[b]} owners")
                        for rid in rids]
            if owners[b] > 1 and b not in block_key:
                bad += [(rid, f"block {b} is shared but not a cached prefix block")
                        for rid in rids]
            in_plain, in_cached = b in plain, b in free_cached
            if owners[b]:
                if in_plain or in_cached:
                    bad += [(rid, f"block {b} is in use and free") for rid in rids]
            elif in_plain == in_cached:
                bad.append((None, f"free block {b} is in {in_plain + in_cached} free lists"))
            if in_cached and b not in block_key:
                bad.append((None, f"evictable block {b} has no cache key"))
        for key, b in self._cached.items():
            if block_key.get(b) != key:
                bad.append((None, f"cache maps a key to block {b} but not back"))
        if any(b not in block_key for b in self._block_digest):
            bad.append((None, "a block has a tier digest but no cache key"))
        if self.tiers is not None:
            bad += [(None, msg) for msg in self.tiers.violations()]
        host_owned = [b for t in self.host_tables.values() for b in t]
        everything = host_owned + self._free_host + self._host_release
        if sorted(everything) != list(range(self.num_swap_blocks)):
            seen: set[int] = set()
            for rid, t in self.host_tables.items():
                if any(b in seen for b in t):
                    bad.append((rid, "owns a host block another request owns"))
                seen.update(t)
            bad.append((None, "host blocks are lost or owned twice"))
        return bad

    def check_consistency(self) -> None:
        """Raise AssertionError listing every violation (used by tests after every step)."""
        bad = self.consistency_violations()
        if bad:
            raise AssertionError("; ".join(f"{rid}: {msg}" if rid else msg for rid, msg in bad))
