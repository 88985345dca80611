"""CPU contention: how many compute threads a step should use, decided while the engine runs.

Why: every parallel region of the CPU kernels (and of torch) ends in a barrier of the OpenMP
team. When another process takes one of the cores the team expects, each region waits for
its descheduled thread, a scheduler time slice of milliseconds, and a decode step holds
~200 regions: the bundled model's `mix` fell from 255 to 3.6 tok/s beside one busy process
on 2 cores, a batch-1 token took 1.33 s (libgomp's spinning waiters make it worse, as they
burn the slice the waited-for thread needs). A smaller team degrades gracefully: one thread
has no barrier at all and gets a whole core beside one busy process. The right team size is
not knowable at start (the load comes and goes), so it is measured.

The signals, cheapest first:
- the ceiling: the CPUs this process may run on (`os.sched_getaffinity`) and the cgroup's
  CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`: a container
  with `--cpus 1.5` sees every host core but gets 1.5 of them), re-read every few seconds;
- step-time drift: each step's time over the fastest time seen for a step of its size (its
  own quiet estimate), kept per team size as a forgetting average of the log ratio;
  `ThreadAdapter` runs the team size whose recent ratio is lowest and re-measures the others
  now and then, backing off (up to a minute) while a probe keeps losing, so a lost probe on
  a busy machine costs one slow step a minute at most. On a quiet machine a probe waits for
  a decode-sized step (`for_step`): a probe due after an idle gap otherwise lands on the
  next request's prefill, and one thread on a 600-token prompt on 2 cores made its TTFT
  1.6x that of a fixed team (benchmarks/contention.py, batch 1, quiet);
- steal time and the runnable count from /proc/stat (a hypervisor or other processes taking
  the CPUs): a change between busy and quiet makes the adapter re-probe at once instead
  of waiting out its back-off.

Outputs do not depend on the team size: the kernels hand each thread whole outputs to sum
(a thread's share changes with the count, an output's order of summation does not), and
greedy text is the same at 1, 2 and a count changing every step on the bundled GGUF and a
float32 checkpoint (tests/model/test_contention.py). Torch-free: the runner (model/runner.py)
applies the choice with torch.set_num_threads on the thread that steps;
engine/omp_policy.py uses `usable_cpus` for its start-up decision.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity_cpus() -> int:
    """CPUs this process may run on (its affinity mask; os.cpu_count where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _quota_v2(d: Path) -> float | None:
    text = _read(d / "cpu.max")
    if text is None:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(d: Path) -> float | None:
    q, p = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    try:
        quota, period = float(q), float(p)       # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
                 ) -> float | None:
    """The CPUs' worth of time this process's cgroup may use per period (None: no quota).

    Every level from the process's own cgroup up to the mount's root is read and the
    tightest quota wins (a parent's limit binds its children). Inside a container the
    cgroup namespace makes the own path "/", so the mount's root is the container's."""
    text = _read(proc_cgroup) or ""
    found: list[float] = []
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":                      # cgroup v2
            mounts, reader = [root], _quota_v2
        elif "cpu" in controllers.split(","):                      # cgroup v1
            mounts, reader = [root / controllers, root / "cpu", root / "cpu,cpuacct"], _quota_v1
        else:
            continue
        rel = Path(path.strip().lstrip("/"))
        mount = next((m for m in mounts if m.is_dir()), root)
        for d in dict.fromkeys([mount / rel, *[mount / p for p in rel.parents]]):
            q = reader(d)
            if q is not None:
                found.append(q)
    return min(found) if found else None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """CPUs a compute team can use: the affinity mask, capped by the cgroup quota rounded
    to the nearest whole CPU (at least 1: a quota of 1.5 throttles two threads together,
    which costs less than leaving half a CPU idle)."""
    n = affinity_cpus()
    q = cgroup_quota(root, proc_cgroup)
    if q is not None:
        n = min(n, max(1, int(q + 0.5)))
    return max(1, n)


@dataclass(frozen=True)
class CpuStat:
    """One reading of /proc/stat: jiffies of all CPUs, of them stolen, runnable threads."""
    total: int
    steal: int
    running: int


def read_cpu_stat(path: Path = Path("/proc/stat")) -> CpuStat | None:
    text = _read(path)
    if not text:
        return None
    total = steal = running = 0
    for line in text.splitlines():
        if line.startswith("cpu "):
            vals = [int(v) for v in line.split()[1:]]
            total = sum(vals[:8])              # guest time is counted in user already
            steal = vals[7] if len(vals) > 7 else 0
        elif line.startswith("procs_running "):
            running = int(line.split()[1])
    return CpuStat(total, steal, running)


def own_running(task_dir: Path = Path("/proc/self/task")) -> int:
    """This process's threads that are runnable now (state R), the reading one included."""
    n = 0
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return 1
    for t in tasks:
        text = _read(t / "stat")
        if text and text[text.rfind(")") + 2:].startswith("R"):
            n += 1
    return max(1, n)


class BusySignal:
    """Whether other work competes for the CPUs, from successive /proc/stat readings:
    more than a tenth of the time stolen (a hypervisor), or on average at least half a
    runnable thread of other processes beside this one's (with hysteresis: quiet again
    below a quarter, so one reading does not flip it)."""

    FORGET = 0.3
    STEAL = 0.10

    def __init__(self) -> None:
        self.prev: CpuStat | None = None
        self.others = 0.0
        self.busy = False

    def update(self, stat: CpuStat, own: int) -> bool:
        prev, self.prev = self.prev, stat
        others = max(0, stat.running - own)
        self.others += self.FORGET * (others - self.others)
        dt = stat.total - prev.total if prev is not None else 0
        stolen = dt > 0 and (stat.steal - prev.steal) / dt > self.STEAL
        self.busy = stolen or self.others >= (0.25 if self.busy else 0.5)
        return self.busy


class ThreadAdapter:
    """The compute team size for the next step, from the measured times of the last ones.

    `threads` is what to run now; `observe(seconds, tokens)` reports a finished step of
    `tokens` batched tokens. With `fixed` set (`--threads N`) it always says N. Pure: the
    clock and the OS readings are injectable, so tests drive it with synthetic step times.
    """

    FORGET = 0.3           # weight of the newest step in a team size's average log ratio
    PROBE_STEPS = 3        # steps a probe runs (one, when its first is clearly worse)
    PROBE_AFTER_S = 2.0    # an estimate older than this gets re-measured ...
    MAX_BACKOFF_S = 60.0   # ... doubling per lost probe, up to this
    CEILING_EVERY_S = 5.0  # re-read affinity and quota
    STAT_EVERY_S = 0.5     # re-read /proc/stat
    PROBE_MAX_TOKENS = 64  # quiet: a probe runs only on steps of at most this many tokens

    def __init__(self, max_threads: int, *, fixed: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 ceiling: Callable[[], int] = usable_cpus,
                 cpu_stat: Callable[[], CpuStat | None] = read_cpu_stat,
                 own_running: Callable[[], int] = own_running) -> None:
        self.fixed = fixed
        self._clock, self._ceiling_fn, self._stat_fn = clock, ceiling, cpu_stat
        self._own_fn = own_running
        self.max_threads = max(1, int(max_threads))
        self._ceiling = self.max_threads
        self._ceiling_at = -math.inf
        self._best: dict[int, float] = {}             # size bucket -> fastest seconds
        self._score: dict[int, float] = {}            # threads -> average log(time / best)
        self._seen: dict[int, float] = {}             # threads -> when last measured
        self._backoff: dict[int, float] = {}          # threads -> seconds before a probe
        self._probe: tuple[int, int, int] | None = None   # (threads, steps left, from)
        self._signal = BusySignal()
        self._stat_at = -math.inf
        self.busy = False
        self.switches = 0
        self._refresh_ceiling(self._clock())
        self.threads = fixed if fixed is not None else self._ceiling
        self._ran: int | None = None                  # team of the step now running
        # The team the last step ran: what /metrics shows. `threads` is the next small
        # step's team, which while a probe waits for one is the probe's, not what runs.
        self.last_ran = self.threads

    # --- the signals --------------------------------------------------------------------
    def _refresh_ceiling(self, now: float) -> None:
        if now - self._ceiling_at < self.CEILING_EVERY_S:
            return
        self._ceiling_at = now
        self._ceiling = max(1, min(self.max_threads, self._ceiling_fn()))

    def _refresh_busy(self, now: float) -> None:
        if now - self._stat_at < self.STAT_EVERY_S:
            return
        self._stat_at = now
        stat = self._stat_fn()
        if stat is None:
            return
        first = self._signal.prev is None
        busy = self._signal.update(stat, self._own_fn())
        if busy != self.busy and not first:     # the machine changed: re-measure at once
            self._backoff.clear()
            for n in [n for n in self._seen if n != self.threads]:
                del self._seen[n]
        self.busy = busy

    # --- the decision -------------------------------------------------------------------
    @staticmethod
    def _bucket(tokens: int) -> int:
        return max(1, int(tokens)).bit_length()

    def for_step(self, tokens: int) -> int:
        """The team size for a step of `tokens` tokens about to run: `threads`, except that
        a pending probe gives way to its home team on a large step while the machine reads
        quiet (there the probe is most likely a loss, and a loss on a prefill chunk is
        paid in TTFT); it stays pending for the next small step. While the busy signal is on,
        a large step may carry the probe: then a smaller team is the likely win."""
        n = self.threads
        if self.fixed is None and self._probe is not None and not self.busy \
                and tokens > self.PROBE_MAX_TOKENS:
            n = self._probe[2]
        self._ran = n
        return n

    def observe(self, seconds: float, tokens: int) -> int:
        """Record a step of `tokens` tokens that took `seconds` at the team `for_step` gave
        it (`self.threads` when it was not asked); returns the team size for the next step."""
        ran, self._ran = self._ran, None
        if self.fixed is not None or seconds <= 0:
            return self.threads
        now = self._clock()
        t = self.threads if ran is None else ran
        self.last_ran = t
        b = self._bucket(tokens)
        best = self._best.get(b)
        if best is None or seconds < best:
            self._best[b] = best = seconds
        ratio = math.log(seconds / best)
        old = self._score.get(t)
        self._score[t] = ratio if old is None or t not in self._seen \
            or now - self._seen[t] > self.PROBE_AFTER_S * 4 \
            else old + self.FORGET * (ratio - old)
        self._seen[t] = now
        self._refresh_ceiling(now)
        self._refresh_busy(now)
        if self._probe is not None and t != self._probe[0]:
            return self.threads          # the probe gave way to this step: still pending
        self.threads = self._next(now, t, ratio)
        return self.threads

    def _next(self, now: float, t: int, ratio: float) -> int:
        ceiling = self._ceiling
        if self._probe is not None:
            pt, left, home = self._probe
            # A first probe step much slower than home's average ends the probe at once.
            lost = ratio > self._score.get(home, 0.0) + math.log(2.0)
            if left > 1 and not lost and pt <= ceiling:
                self._probe = (pt, left - 1, home)
                return pt
            self._probe = None
            if self._score[pt] < self._score.get(home, math.inf):
                self._backoff.pop(pt, None)
            else:
                self._backoff[pt] = min(self.MAX_BACKOFF_S,
                                        2 * self._backoff.get(pt, self.PROBE_AFTER_S))
        sizes = range(1, ceiling + 1)
        fresh = {n: s for n, s in self._score.items()
                 if n <= ceiling and now - self._seen.get(n, -math.inf) <= self.MAX_BACKOFF_S}
        choice = min(fresh, key=fresh.__getitem__) if fresh else ceiling
        # Re-measure the size whose estimate is the most overdue (neighbours first).
        due = [n for n in sizes if n != choice and now - self._seen.get(n, -math.inf)
               > self._backoff.get(n, self.PROBE_AFTER_S)]
        if due:
            pt = min(due, key=lambda n: (abs(n - choice), -n))
            self._probe = (pt, self.PROBE_STEPS - 1, choice)
            choice = pt
        if choice != t:
            self.switches += 1
        return choice
