"""AsyncEngine: the LLMEngine behind an asyncio API, stepping in the background.

Threading model: every call into the LLMEngine (add, abort, step, stats) runs on ONE worker
thread, in submission order, so the engine needs no lock and the event loop never blocks on
a forward pass. The background loop submits `step()` while there is work and hands each
RequestOutput to its request's asyncio.Queue; an add or abort submitted meanwhile runs right
after the current step.

A consumer that goes away (client disconnect, task cancelled, generator closed) aborts its
request in the generator's `finally`: the abort is queued on the worker thread at once, so
the request's blocks are free before the next step is scheduled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

from iterserve.core.request import SamplingParams
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shutdown or a fatal error); no request can be served."""


def _engine_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                 thread_name_prefix="iterserve-engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_sleep: float = 0.002,
                 thread: concurrent.futures.ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self._thread = thread or _engine_thread()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._idle_sleep = idle_sleep
        self._counter = 0
        self._counter_lock = threading.Lock()

    @classmethod
    def from_engine_args(cls, args: Any, **kw: Any) -> "AsyncEngine":
        """Build the engine on the thread that will step it.

        Why: torch's CPU ops and the native kernels run on OpenMP (libgomp), which keeps one
        worker team per thread that ever started a parallel region. Loading the model on the
        main thread and stepping on the engine thread made two teams, more OpenMP threads
        than the 2 cores, and libgomp then stops spinning between parallel regions: every
        one of a step's ~300 regions paid a futex wake-up. The server ran `mix` at 92 output
        tok/s against 133 offline; with one team it matches offline."""
        thread = _engine_thread()
        engine = thread.submit(LLMEngine.from_engine_args, args, **kw).result()
        return cls(engine, thread=thread)

    # --- plumbing -----------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    def next_request_id(self, prefix: str = "req") -> str:
        with self._counter_lock:
            self._counter += 1
            return f"{prefix}-{self._counter}"

    async def run_in_engine(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run `fn` on the engine thread (serialised with steps) and await its result."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, lambda: fn(*args, **kw))

    def start(self) -> None:
        if self.is_running:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_task = self._loop.create_task(self._run_loop(), name="iterserve-engine-loop")

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            if not self.engine.has_unfinished_requests():
                self._work.clear()
                if not self.engine.has_unfinished_requests():
                    await self._work.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._thread, self.engine.step)
            except Exception as e:           # the engine itself broke: fail everyone, go on
                logger.exception("engine step failed")
                for rid, q in list(self._streams.items()):
                    q.put_nowait(e)
                    self._thread.submit(self.engine.abort_request, rid)
                await asyncio.sleep(0.01)
                continue
            for out in outputs:
                q = self._streams.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if not outputs:
                await asyncio.sleep(self._idle_sleep)   # blocked (e.g. no free blocks): don't spin
            else:
                await asyncio.sleep(0)                  # let consumers run between steps

    # --- the API --------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | Sequence[int],
                          params: SamplingParams, **kw: Any
                          ) -> tuple[list[int], asyncio.Queue]:
        """Validate and queue a request; raises the engine's ValueErrors / QueueFullError."""
        self.start()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        try:
            prompt_ids = await self.run_in_engine(self.engine.add_request, request_id, prompt,
                                                  params, **kw)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._work.set()
        return prompt_ids, q

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, **kw: Any) -> AsyncIterator[RequestOutput]:
        """Add a request and stream its outputs; validation errors raise before the first
        output. Leaving the loop early (or cancelling) aborts the request."""
        request_id = request_id or self.next_request_id()
        _, q = await self.add_request(request_id, prompt, params or SamplingParams(), **kw)
        return self._stream(request_id, q)

    async def _stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort from any context (sync, no await): queued on the engine thread now."""
        self._streams.pop(request_id, None)
        if self._closed:
            return
        try:
            self._thread.submit(self.engine.abort_request, request_id)
        except RuntimeError:          # executor already shut down
            return
        self._wake()

    def _wake(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._work.set()
        else:
            loop.call_soon_threadsafe(self._work.set)

    async def stats(self) -> dict[str, Any]:
        return await self.run_in_engine(self.engine.stats)

    async def get_trace(self, request_id: str) -> dict[str, Any] | None:
        return await self.run_in_engine(self.engine.get_trace, request_id)

    async def shutdown(self, *, abort_in_flight: bool = True, drain_timeout: float = 0.0) -> None:
        """Stop the loop: optionally let in-flight requests finish for `drain_timeout`
        seconds, then abort what is left and end every stream."""
        if self._closed:
            return
        if drain_timeout > 0 and self.is_running:
            deadline = asyncio.get_running_loop().time() + drain_timeout
            while self._streams and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
        if abort_in_flight:
            for rid in list(self._streams):
                q = self._streams.pop(rid)
                self._thread.submit(self.engine.abort_request, rid)
                q.put_nowait(EngineDeadError("the server is shutting down"))
        self._closed = True
        self._work.set()
        if self._loop_task is not None:
            try:
                await asyncio.wait_for(self._loop_task, timeout=10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._loop_task.cancel()
        # Flush the aborts so blocks are freed, then stop the thread.
        await asyncio.get_running_loop().run_in_executor(None, self._thread.shutdown, True)
