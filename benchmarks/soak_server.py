"""`iterserve serve` with a soak probe (benchmarks only, never in the product).

    python benchmarks/soak_server.py [serve flags...]

The same app as `iterserve serve` (server.cli.build_app, the DrainingServer, the same flags),
plus one extra route, GET /debug/soak, that answers what a soak needs to tell a leak from a
plateau:

- `sizes`: every per-request / bounded structure of the engine (engine.bookkeeping.sizes,
  read on the engine thread, so it never races a step) and of the event loop (asyncio tasks);
- `rss_mb` and, with `?trim=1`, RSS before/after glibc `malloc_trim(0)`: memory that trim
  gives back was free but held by the allocator (fragmentation / arena caching), not objects;
- `gc`: live objects by type (top 25 and the diff against the first call), after a collect;
- `tracemalloc` (with env SOAK_TRACEMALLOC=frames): the top allocation sites by growth since
  the first call (the first call takes the baseline snapshot).

Environment: SOAK_TRACEMALLOC=N starts tracemalloc with N frames before the model loads
(slow: a step costs several times more; use it for short probes only).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import os
import sys
import tracemalloc
from typing import Any

_FRAMES = int(os.environ.get("SOAK_TRACEMALLOC", "0") or 0)
if _FRAMES:
    tracemalloc.start(_FRAMES)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def _mallinfo() -> dict[str, float] | None:
    """glibc's heap: `in_use_mb` is malloc'd and not freed (live objects, torch tensors
    included), `free_mb` free but held by the allocator (fragmentation), `mmap_mb` big blocks
    served by mmap (given back on free)."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    m = fn()
    mb = 2 ** 20
    return {"heap_mb": round(m.arena / mb, 1), "in_use_mb": round(m.uordblks / mb, 1),
            "free_mb": round(m.fordblks / mb, 1), "mmap_mb": round(m.hblkhd / mb, 1),
            "mmap_blocks": m.hblks}


def _resident_mb(tensors: list) -> float | None:
    """Resident MB of the pages under `tensors` (from /proc/self/pagemap's present bit): how
    much of a lazily touched pool (the KV cache) is backed by memory yet."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        f = open("/proc/self/pagemap", "rb")
    except OSError:
        return None
    present = 0
    with f:
        for t in tensors:
            start = t.data_ptr() // page
            end = (t.data_ptr() + t.numel() * t.element_size() + page - 1) // page
            f.seek(start * 8)
            raw = f.read((end - start) * 8)
            present += sum(1 for i in range(7, len(raw), 8) if raw[i] & 0x80)
    return round(present * page / 2**20, 1)


def _malloc_trim() -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


class Probe:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.gc0: collections.Counter | None = None
        self.snap0: tracemalloc.Snapshot | None = None

    def gc_counts(self) -> dict[str, Any]:
        gc.collect()
        counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
        if self.gc0 is None:
            self.gc0 = counts
        diff = counts.copy()
        diff.subtract(self.gc0)
        grown = [(k, v) for k, v in diff.most_common(25) if v > 0]
        return {"total": sum(counts.values()), "top": counts.most_common(25), "grown": grown}

    def tracemalloc_diff(self) -> dict[str, Any] | None:
        if not tracemalloc.is_tracing():
            return None
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)])
        if self.snap0 is None:
            self.snap0 = snap
        stats = snap.compare_to(self.snap0, "traceback")
        current, peak = tracemalloc.get_traced_memory()
        top = []
        for s in stats[:15]:
            top.append({"size_diff_kb": round(s.size_diff / 1024, 1), "count_diff": s.count_diff,
                        "size_kb": round(s.size / 1024, 1),
                        "where": [f"{fr.filename.split('site-packages/')[-1]}:{fr.lineno}"
                                  for fr in s.traceback[-6:]]})
        return {"traced_mb": round(current / 2**20, 2), "top_growth": top}

    async def report(self, trim: bool) -> dict[str, Any]:
        from iterserve.engine.bookkeeping import sizes
        out: dict[str, Any] = {"sizes": await self.engine.run_in_engine(sizes, self.engine),
                               "asyncio_tasks": len(asyncio.all_tasks())}
        out["rss_mb"] = round(_rss_mb(), 1)
        out["malloc"] = _mallinfo()
        kv = getattr(getattr(self.engine.engine, "executor", None), "kv_cache", None)
        if kv is not None:
            pools = list(kv.k) + list(kv.v)
            out["kv_pool_mb"] = round(sum(t.numel() * t.element_size() for t in pools) / 2**20, 1)
            out["kv_resident_mb"] = _resident_mb(pools)
        if trim:
            out["trimmed"] = _malloc_trim()
            out["rss_mb_after_trim"] = round(_rss_mb(), 1)
        out["gc"] = self.gc_counts()
        out["tracemalloc"] = self.tracemalloc_diff()
        return out


def main(argv: list[str] | None = None) -> int:
    from iterserve.server import cli as serve_cli

    parser = argparse.ArgumentParser(prog="soak_server")
    sub = parser.add_subparsers()
    serve_cli.register(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])

    original = serve_cli.build_app

    def build_app_with_probe(a: argparse.Namespace):
        app, engine = original(a)
        probe = Probe(engine)

        @app.get("/debug/soak", include_in_schema=False)
        async def debug_soak(trim: int = 0) -> dict[str, Any]:
            return await probe.report(bool(trim))

        return app, engine

    serve_cli.build_app = build_app_with_probe
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
