"""Load-time phases, logged as each ends: where the seconds before the first token go.

Why: "process start to first token" is one number a user sees (BENCHMARKS.md compares it
with llama-server's); this splits it so a regression names its phase. Every phase logs one line
at info level on the `iterserve.startup` logger,

    startup <phase> <seconds> s (at <seconds> s since process start)

which `benchmarks/memory.py` parses. `imports` is the time from process start to the first
phase (interpreter start, imports, argument parsing); the rest are timed where they run
(metadata, tokenizer, weights, kv_alloc, runner, ...). No dependency beyond the stdlib, so
the torch-free layers may use it too.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("iterserve.startup")

_imports_logged = False


def since_process_start() -> float | None:
    """Seconds since this process started (from /proc; None where there is no /proc)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _log(name: str, seconds: float) -> None:
    at = since_process_start()
    log.info("startup %-10s %6.2f s%s", name, seconds,
             "" if at is None else f" (at {at:.2f} s since process start)")


def log_imports() -> None:
    """Once per process: the time from process start to now (imports, argument parsing)."""
    global _imports_logged
    if _imports_logged:
        return
    _imports_logged = True
    at = since_process_start()
    if at is not None:
        log.info("startup %-10s %6.2f s (process start to engine build)", "imports", at)


class phase:
    """`with phase("weights"): ...` logs how long the block took."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.t0 = 0.0

    def __enter__(self) -> "phase":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            _log(self.name, time.perf_counter() - self.t0)
