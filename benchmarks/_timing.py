"""Timing functions shared by the kernel microbenchmarks (bench_int8.py; bench_bf16.py can use
them too): one call's mean time over a minimum duration, and same-process alternating A/B of
several callables with each side's median, the way kernel changes are judged on a loaded
machine (other processes slow every side alike; medians drop the outliers)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def time_call(fn: Callable[[], object], min_s: float, clock: Callable[[], float] = time.perf_counter,
              min_calls: int = 1) -> float:
    """Seconds per call of fn: one warm-up call, then calls until min_s (and min_calls) pass."""
    fn()
    n, t0 = 0, clock()
    while True:
        fn()
        n += 1
        dt = clock() - t0
        if dt >= min_s and n >= min_calls:
            return dt / n


def alternate(sides: dict[str, Callable[[], object]], repeats: int, min_s: float,
              clock: Callable[[], float] = time.perf_counter,
              prepare: dict[str, Callable[[], object]] | None = None,
              min_calls: int = 1) -> dict[str, float]:
    """Median seconds per call of each side, timed in turn `repeats` times (A B C A B C ...);
    prepare[name], where given, runs before each of that side's timings (a mode or variant
    switch that must not be inside the timed call)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            if prepare and name in prepare:
                prepare[name]()
            times[name].append(time_call(fn, min_s, clock, min_calls))
    return {name: statistics.median(ts) for name, ts in times.items()}
