"""Worker threads for the grammar engine: a large, explicit stack, and a lower CPU priority.

Why not a ThreadPoolExecutor: its threads get the process's default stack (8 MiB under a
default `ulimit -s`), and llguidance's grammar compiler recurses: a chain of 3,500 Lark rules
overflowed it and the segfault took the whole server down (the same grammar compiles in a
256 MiB thread; a chain of 30,000 rules needs about that). The limits
(structured/limits.py) keep requests far below that depth; the stack is the second line.
Only touched stack pages are committed, so a large stack costs address space, not memory.

`nice`: compiling a constraint is one request's work; a thread below the engine's priority
takes the CPU the forward pass leaves, so a slow compile does not slow everyone's steps on a
machine whose cores the forward pass fills (Linux gives each thread its own nice value).

Growth: `num_workers` threads start on demand; a job that overruns (a compile past its time
budget cannot be interrupted: the engine's Rust code runs to the end) keeps its thread, and
further threads start while none is idle, up to `max_workers`, so one slow constraint does
not queue everyone else's behind it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

STACK_BYTES = 256 << 20
_STACK_LOCK = threading.Lock()


def start_thread(target: Callable[[], Any], name: str, stack_bytes: int = STACK_BYTES
                 ) -> threading.Thread:
    """A daemon thread with a stack of `stack_bytes` (threading.stack_size is process-wide,
    so it is set and restored under a lock around the start)."""
    with _STACK_LOCK:
        old = threading.stack_size()
        try:
            threading.stack_size(stack_bytes)
        except (ValueError, RuntimeError):       # a platform without settable stacks
            log.warning("cannot set a %d-byte thread stack here", stack_bytes)
        try:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    return t


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by `nice` (Linux: per thread; elsewhere the
    call may apply to the process, so it is skipped)."""
    if nice <= 0 or not hasattr(os, "setpriority") or not os.path.exists("/proc/self/task"):
        return
    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice))
    except OSError:
        pass


class WorkerPool:
    """submit(fn, *args) -> concurrent.futures.Future, on big-stack, lowered-priority
    threads (see the module docstring)."""

    def __init__(self, name: str, num_workers: int = 1, *, max_workers: int | None = None,
                 stack_bytes: int = STACK_BYTES, nice: int = 0) -> None:
        self.name = name
        self.num_workers = max(1, num_workers)
        self.max_workers = max(self.num_workers, max_workers or self.num_workers)
        self.stack_bytes = stack_bytes
        self.nice = nice
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._spawned = 0
        self._closed = False

    @property
    def num_threads(self) -> int:
        return self._spawned

    def submit(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError(f"{self.name}: the pool is shut down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fut, fn, args, kw))
        with self._lock:
            n = self._spawned
            grow = n < self.num_workers or (self._idle == 0 and n < self.max_workers)
            if grow:
                self._spawned += 1
                self._idle += 1          # counted idle until it takes its first job
        if grow:
            t = start_thread(self._work, f"{self.name}-{n}", self.stack_bytes)
            with self._lock:
                self._threads.append(t)
        return fut

    def _work(self) -> None:
        lower_priority(self.nice)
        while True:
            item = self._jobs.get()
            if item is None:
                return
            with self._lock:
                self._idle -= 1
            fut, fn, args, kw = item
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args, **kw))
                    except BaseException as e:       # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
            finally:
                with self._lock:
                    self._idle += 1

    def shutdown(self) -> None:
        """Stop taking jobs; threads end after their current one (never joined: a job may
        run on in native code)."""
        self._closed = True
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(self._spawned):
            self._jobs.put(None)
