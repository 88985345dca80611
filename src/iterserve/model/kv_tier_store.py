"""The bytes of the KV tiers: the RAM tier's copies and the disk tier's block files.

core/kv_tiers.py decides which block lives where; this module does what a step's
`KVTierOps` say, against the `PagedKVCache`'s pools (the RAM tier is host pool slots after
the swap pool's, copied with the swap mechanism) and a `DiskStore` directory, and reports
back (`KVTierFeedback`): reads that found a file missing or corrupt, writes that failed,
device blocks a failed load left wrong, and what the copies cost.

Disk I/O stays off the step. A write copies the block out of the pool (one strided copy:
the block may be reused by the very next step) and queues it for a writer thread; a read
(a "promotion" from disk into a RAM slot) is a future on a small reader pool that runs while
the forward pass computes; the request it serves is admitted the next step, when its RAM
load first waits for that future (`_settle`). Every op on a slot settles the slot's pending
read first, so a read can never land after a later copy into the same slot.

A read that fails (a torn or corrupt file: checksums; a file of another model or setting:
its key; a file another process deleted) is never turned into wrong tokens: the slot is
marked bad, a load from it marks its device block bad, and the runner recomputes those
tokens in the same step (`ModelRunner`: a chunk that would read a bad block starts at it).

File format (one block per file, `<dir>/<setting>/<aa>/<digest>.kv`, written to a temporary
name and renamed, so a reader sees a whole file or none):

    magic "ITKVBLK1" | u32 header_len | u64 header_hash | u64 payload_len | u64 payload_hash
    | header (JSON: setting key, digest, shape, dtype) | payload (the block's K/V, all layers)

Hashes are xxh3-64 (about 8x zlib's crc32 here): they detect torn and corrupted files, not
forgeries; the digest in the name is the block's identity (core/kv_tiers.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

from iterserve.core.scheduler_output import KVTierFeedback, KVTierOps
from iterserve.model.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"ITKVBLK1"
_FIXED = struct.Struct("<8sIQQQ")           # magic, header_len, header_hash, payload_len, hash
SUFFIX = ".kv"
STALE_TMP_S = 600          # a temporary file older than this is a crashed writer's
DEFAULT_MAX_PENDING_WRITE_BYTES = 256 << 20


class CorruptBlockError(ValueError):
    """A block file that is torn, corrupt, or not this setting's (the message says which)."""


def model_identity(loaded) -> list:
    """What names the weights: every file the model was read from (path, size, mtime), so a
    replaced, rewritten or other checkpoint is another identity (content hashes of a header
    would call two random-weight models of one shape the same)."""
    paths = sorted({getattr(r, "path", None) for r in getattr(loaded, "refs", {}).values()}
                   - {None})
    if not paths and getattr(loaded, "path", None):
        paths = [loaded.path]
    base = Path(loaded.path) if getattr(loaded, "path", None) else None
    if base is not None and base.is_dir() and (base / "config.json").exists():
        paths.append(str(base / "config.json"))
    out = []
    for p in paths:
        st = os.stat(p)
        out.append([os.path.realpath(p), st.st_size, st.st_mtime_ns])
    return out


def setting_key(loaded, *, block_size: int, kv_dtype: torch.dtype, kernel_activations: str,
                device: str) -> str:
    """Everything that changes the bytes of a block, as one canonical string: the model
    files, the architecture's shape, the compute and KV dtypes, the block size, the
    kernels' activation mode (int8 activations give other K/V than float) and the device
    type. Blocks are only ever read by a process whose key is the same."""
    cfg = loaded.config
    return json.dumps({
        "format": FORMAT_VERSION, "model": model_identity(loaded),
        "arch": [cfg.model_type, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim],
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "kv_dtype": str(kv_dtype).removeprefix("torch."), "block_size": block_size,
        "kernel_activations": kernel_activations, "device": torch.device(device).type,
    }, sort_keys=True, separators=(",", ":"))


def block_file_bytes(key: str, config, block_size: int) -> int:
    """The size of one block file of this setting (what the disk tier's bound counts)."""
    kv_dtype = config.kv_cache_dtype or config.dtype
    shape = (2, config.num_layers, block_size, config.num_kv_heads, config.head_dim)
    return DiskStore.file_size(key, shape, kv_dtype)


def _hash(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


class DiskStore:
    """The block files of one setting: `<root>/<setting hash>/<digest[:2]>/<digest>.kv`.

    Several processes may share `root` (data-parallel replicas, a restart while the old
    process is still exiting): files are content-addressed and renamed into place whole,
    so two writers of one block leave one good file and a reader never sees half of one."""

    def __init__(self, root: str | os.PathLike, key: str, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.key = key
        self.key_hash = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
        self.dir = Path(root).expanduser() / self.key_hash
        self.dir.mkdir(parents=True, exist_ok=True)
        setting = self.dir / "setting.json"         # for people: what these blocks are
        if not setting.exists():
            setting.write_text(key + "\n")
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.payload_bytes = torch.empty(block_shape, dtype=dtype, device="meta").nbytes
        self.file_bytes = self.file_size(key, block_shape, dtype)

    @staticmethod
    def _header_of(key: str, digest: str, shape, dtype: torch.dtype) -> bytes:
        return json.dumps({"key": key, "digest": digest, "shape": list(shape),
                           "dtype": str(dtype).removeprefix("torch.")}, sort_keys=True).encode()

    @classmethod
    def file_size(cls, key: str, shape, dtype: torch.dtype) -> int:
        payload = torch.empty(tuple(shape), dtype=dtype, device="meta").nbytes
        return _FIXED.size + len(cls._header_of(key, "0" * 64, shape, dtype)) + payload

    def _header(self, digest: str) -> bytes:
        return self._header_of(self.key, digest, self.block_shape, self.dtype)

    def path(self, digest: str) -> Path:
        return self.dir / digest[:2] / (digest + SUFFIX)

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def scan(self) -> list[str]:
        """Digests of the block files here, least recently used (mtime) first; temporary
        files a crashed writer left behind are removed."""
        found: list[tuple[int, str]] = []
        now = time.time()
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                name = f.name
                try:
                    if name.endswith(SUFFIX) and len(name) == 64 + len(SUFFIX):
                        found.append((f.stat().st_mtime_ns, name[:-len(SUFFIX)]))
                    elif name.endswith(".tmp") and now - f.stat().st_mtime > STALE_TMP_S:
                        f.unlink()
                except FileNotFoundError:
                    continue        # (another process removed it meanwhile)
        found.sort()
        return [d for _, d in found]

    def encode(self, digest: str, payload) -> list:
        """The file's bytes as buffers (fixed header, JSON header, payload)."""
        header = self._header(digest)
        fixed = _FIXED.pack(MAGIC, len(header), _hash(header), len(payload), _hash(payload))
        return [fixed, header, payload]

    def write(self, digest: str, payload) -> None:
        """Write one block file (raises OSError: a full disk, a read-only directory)."""
        path = self.path(digest)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                for part in self.encode(digest, payload):
                    f.write(part)
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise

    def read(self, digest: str) -> memoryview:
        """The payload of `digest`'s file, checked; FileNotFoundError when there is none,
        CorruptBlockError when it is torn, corrupt or another setting's."""
        with open(self.path(digest), "rb") as f:
            data = f.read()
        if len(data) < _FIXED.size:
            raise CorruptBlockError(f"block {digest[:16]}: {len(data)} bytes, a torn file")
        magic, hlen, hhash, plen, phash = _FIXED.unpack_from(data)
        if magic != MAGIC:
            raise CorruptBlockError(f"block {digest[:16]}: not a block file")
        if len(data) != _FIXED.size + hlen + plen or plen != self.payload_bytes:
            raise CorruptBlockError(f"block {digest[:16]}: {len(data)} bytes, expected "
                                    f"{_FIXED.size + hlen + self.payload_bytes} (torn)")
        header = data[_FIXED.size:_FIXED.size + hlen]
        if _hash(header) != hhash:
            raise CorruptBlockError(f"block {digest[:16]}: header checksum mismatch")
        try:
            meta = json.loads(header)
        except ValueError:
            raise CorruptBlockError(f"block {digest[:16]}: unreadable header") from None
        if meta.get("key") != self.key or meta.get("digest") != digest:
            raise CorruptBlockError(f"block {digest[:16]}: written for another model, "
                                    "setting or block")
        payload = memoryview(data)[_FIXED.size + hlen:]
        if _hash(payload) != phash:
            raise CorruptBlockError(f"block {digest[:16]}: payload checksum mismatch")
        return payload

    def touch(self, digest: str) -> None:
        """Mark a file used (its mtime orders the LRU a restart rebuilds)."""
        try:
            os.utime(self.path(digest))
        except OSError:
            pass

    def delete(self, digest: str) -> None:
        try:
            self.path(digest).unlink()
        except FileNotFoundError:
            pass


class KVTierStore:
    """Runs a step's KVTierOps against a PagedKVCache's pools and an optional DiskStore.

    The runner calls `save_and_read(ops)` before its swaps, `load(ops)` after them, and
    `feedback(...)` once the step ran; `close()` at shutdown writes what is still queued."""

    def __init__(self, kv_cache: PagedKVCache, disk: DiskStore | None = None, *,
                 max_pending_write_bytes: int = DEFAULT_MAX_PENDING_WRITE_BYTES,
                 reader_threads: int = 2) -> None:
        self.kv = kv_cache
        self.disk = disk
        self.max_pending_write_bytes = max_pending_write_bytes
        self._lock = threading.Lock()                 # what the writer / readers share
        self._failed_writes: list[str] = []
        self._failed_reads: list[tuple[str, int]] = []
        self._read_s = [0.0, 0]                       # disk reads booked: seconds, blocks
        self._pending_reads: dict[int, tuple[str, Future]] = {}   # slot -> (digest, read)
        self._bad_slots: set[int] = set()             # RAM slots without their digest's data
        self._staged: dict[str, torch.Tensor] = {}    # digest -> block queued for writing
        self._warned: set[str] = set()
        self.counters = {"writes": 0, "write_failures": 0, "reads": 0, "read_failures": 0,
                         "deletes": 0}
        self._queue: queue.Queue | None = None
        self._readers: ThreadPoolExecutor | None = None
        if disk is not None:
            self._queue = queue.Queue()
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name="kv-tier-writer")
            self._writer.start()
            self._readers = ThreadPoolExecutor(reader_threads, thread_name_prefix="kv-tier-read")

    # --- one step -------------------------------------------------------------------------
    def save_and_read(self, ops: KVTierOps) -> None:
        """The ops that read device blocks or start off the step, before the swaps: RAM
        saves, disk saves (copied out now, written later), deletes, disk reads (started)."""
        if ops.ram_saves:
            for _, slot in ops.ram_saves:
                self._settle(slot)
                self._bad_slots.discard(slot)
            self.kv.swap_out(ops.ram_saves)
        for block, digest in ops.disk_saves:
            self._stage_write(block, digest)
        for digest in ops.disk_deletes:
            self._queue.put(("delete", digest, None))
        for digest, slot in ops.disk_reads:
            self._settle(slot)
            self._bad_slots.add(slot)                 # until its read succeeds
            self._pending_reads[slot] = (digest, self._readers.submit(self._read, digest, slot))

    def load(self, ops: KVTierOps) -> tuple[set[int], tuple[float, int]]:
        """The RAM loads, after the swaps: (device blocks a bad slot left without their
        data, (seconds, blocks) of the copy)."""
        bad: set[int] = set()
        pairs = []
        for slot, block in ops.ram_loads:
            self._settle(slot)
            if slot in self._bad_slots:
                bad.add(block)
            else:
                pairs.append((slot, block))
        if not pairs:
            return bad, (0.0, 0)
        t = time.perf_counter()
        self.kv.swap_in(pairs)
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)    # (to time it)
        return bad, (time.perf_counter() - t, len(pairs))

    def _settle(self, slot: int) -> None:
        """Wait for `slot`'s pending disk read, if any, and book its outcome."""
        pending = self._pending_reads.pop(slot, None)
        if pending is not None:
            digest, fut = pending
            self._book_read(digest, slot, *fut.result())

    def _book_read(self, digest: str, slot: int, ok: bool, seconds: float) -> None:
        if ok:
            self._bad_slots.discard(slot)
            self._read_s[0] += seconds
            self._read_s[1] += 1
        else:
            self._bad_slots.add(slot)
            self._failed_reads.append((digest, slot))

    def feedback(self, *, ram_load: tuple[float, int] = (0.0, 0), compute_s: float = 0.0,
                 compute_tokens: int = 0, invalid_blocks=()) -> KVTierFeedback | None:
        """What happened since the last call (reads that completed meanwhile included);
        None when there is nothing to say."""
        for slot, (digest, fut) in list(self._pending_reads.items()):
            if fut.done():
                del self._pending_reads[slot]
                self._book_read(digest, slot, *fut.result())
        with self._lock:
            failed_writes, self._failed_writes = self._failed_writes, []
        failed_reads, self._failed_reads = self._failed_reads, []
        load_s = {}
        if ram_load[1]:
            load_s["ram"] = ram_load
        if self._read_s[1]:
            load_s["disk"] = (self._read_s[0], self._read_s[1])
            self._read_s = [0.0, 0]
        if not (failed_reads or failed_writes or load_s or compute_tokens or invalid_blocks):
            return None
        return KVTierFeedback(failed_reads=failed_reads, failed_writes=failed_writes,
                              invalid_blocks=sorted(invalid_blocks), load_s=load_s,
                              compute_s=compute_s, compute_tokens=compute_tokens)

    # --- disk writes (the writer thread) --------------------------------------------------
    def _stage_write(self, block: int, digest: str) -> None:
        """Copy the block out of the pool now (the next step may reuse it) and queue it."""
        with self._lock:
            if digest in self._staged:
                return
            behind = len(self._staged) * self.disk.payload_bytes >= self.max_pending_write_bytes
            if behind:
                self._failed_writes.append(digest)
                self.counters["write_failures"] += 1
        if behind:
            self._warn_once("behind", "KV disk tier: the writer is %d MiB behind; blocks are "
                            "left unwritten until it catches up",
                            self.max_pending_write_bytes >> 20)
            return
        data = torch.empty(self.kv.block_shape, dtype=self.kv.dtype)
        data.copy_(self.kv.block_view(block))
        with self._lock:
            self._staged[digest] = data
        self._queue.put(("write", digest, data))

    def _write_loop(self) -> None:
        q = self._queue
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                kind, digest, data = item
                if kind == "delete":
                    self.disk.delete(digest)
                    with self._lock:
                        self.counters["deletes"] += 1
                else:
                    self._write(digest, data)
            finally:
                q.task_done()

    def _write(self, digest: str, data: torch.Tensor) -> None:
        try:
            self.disk.write(digest, _bytes_of(data))
            with self._lock:
                self.counters["writes"] += 1
        except OSError as e:
            with self._lock:
                self._failed_writes.append(digest)
                self.counters["write_failures"] += 1
            self._warn_once(f"write:{e.errno}", "KV disk tier: writing a block under %s failed "
                            "(%s); such blocks are recomputed when needed", self.disk.dir, e)
        finally:
            with self._lock:
                if self._staged.get(digest) is data:
                    del self._staged[digest]

    # --- disk reads (the reader pool) ------------------------------------------------------
    def _read(self, digest: str, slot: int) -> tuple[bool, float]:
        """Read `digest` into host `slot`: (ok, seconds). Never raises."""
        t = time.perf_counter()
        try:
            dst = _uint8_numpy(self.kv.host_view(slot))
            with self._lock:
                staged = self._staged.get(digest)
            if staged is not None:                    # still queued for writing
                np.copyto(dst, _uint8_numpy(staged))
            else:
                payload = self.disk.read(digest)
                np.copyto(dst, np.frombuffer(payload, dtype=np.uint8).reshape(dst.shape))
                self.disk.touch(digest)
            with self._lock:
                self.counters["reads"] += 1
            return True, time.perf_counter() - t
        except FileNotFoundError:
            # Another process sharing the directory evicted it: an ordinary miss.
            log.debug("KV disk tier: block %s is gone; its tokens are recomputed", digest[:16])
        except CorruptBlockError as e:
            log.warning("KV disk tier: %s; the file is removed and its tokens recomputed", e)
            self.disk.delete(digest)
        except Exception as e:                         # an I/O error: a miss, said once
            self._warn_once(f"read:{type(e).__name__}", "KV disk tier: reading a block "
                            "failed (%s: %s); its tokens are recomputed", type(e).__name__, e)
        with self._lock:
            self.counters["read_failures"] += 1
        return False, time.perf_counter() - t

    # --- life -----------------------------------------------------------------------------
    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    def pending_writes(self) -> int:
        with self._lock:
            return len(self._staged)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write and delete is done (True) or `timeout` passed."""
        if self._queue is None:
            return True
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes (up to `timeout`), then stop the threads."""
        if self._queue is None:
            return
        if not self.flush(timeout):
            log.warning("KV disk tier: %d block writes still queued at shutdown were dropped",
                        self.pending_writes())
        self._queue.put(None)
        # Joined, not left to the interpreter: a daemon thread still waking from its queue
        # while the process finalises is torn down mid-call (seen as an abort at exit).
        self._writer.join(timeout)
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._queue = None

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters)
            out["pending_writes"] = len(self._staged)
        if self.disk is not None:
            out["dir"] = str(self.disk.dir)
            out["file_bytes"] = self.disk.file_bytes
        return out


def _uint8_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a (possibly strided) numpy array: numpy copies on the
    calling thread, where torch's copy would start an OpenMP team on a reader thread."""
    return t.view(torch.uint8).numpy()


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(_uint8_numpy(t.contiguous())).cast("B")
