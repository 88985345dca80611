"""AsyncEngine: the LLMEngine behind an asyncio API, stepping in the background.

Threading model: every call into the LLMEngine (add, abort, step, stats) runs on ONE worker
thread, in submission order, so the engine needs no lock and the event loop never blocks on
a forward pass. The background loop submits `step()` while there is work and hands each
RequestOutput to its request's asyncio.Queue; an add or abort submitted meanwhile runs right
after the current step.

Text work runs on a second small pool, never on the event loop nor on the engine thread:
tokenising a prompt and rendering a chat template. The tokenizer's batch call releases the
GIL (its single-text `encode` does not: a 4 MB prompt held the GIL for 3.5 s), and the token
count is checked against max_model_len before the ids become a Python list. A text longer
than any prompt that can fit (max_model_len x the longest vocabulary entry x 4 characters)
is refused before it is tokenised at all: freeing the tokenizer's result for a 4 MB text
alone held the GIL for 0.56 s. So a huge prompt costs the server neither `/health` nor a
stalled step.

A consumer that goes away (client disconnect, task cancelled, generator closed) aborts its
request in the generator's `finally`: the abort is queued on the worker thread at once, so
the request's blocks are free before the next step is scheduled.

The server uses only this class's public API; this class uses only LLMEngine's public API
(add_request, abort_request, step, has_unfinished_requests, stats, scheduler_stats,
get_trace, check_health, model_name, tokenizer, max_model_len, vocab_size, stat_loggers).

Structured outputs: a request's constraint is compiled before its add reaches the engine
thread (`_compile_constraint`, on the compiler's own worker threads), and the compiler is
warmed on a background thread when the loop starts; the engine thread only ever finds the
grammar ready. So neither the first constrained request nor a slow constraint stalls a step.

Consistency: when the engine goes idle, and after every step with
`debug_check_consistency`, the engine thread runs `LLMEngine.check_health()`, which checks the
scheduler's books, logs each violation with its request ids and ends the offending requests
with finish reason "error" (their streams end normally).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

from iterserve.core.request import PoolingParams, SamplingParams
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.outputs import RequestOutput
from iterserve.errors import (EmptyPromptError, EngineDeadError, InvalidRequestError,
                              IterserveError, PromptTooLongError)

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["AsyncEngine", "EngineDeadError"]


def _engine_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                 thread_name_prefix="iterserve-engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_sleep: float = 0.002,
                 thread: concurrent.futures.ThreadPoolExecutor | None = None,
                 scheduling_policy: str | None = None,
                 debug_check_consistency: bool = False, text_workers: int = 2,
                 add_grace: float = 0.005, warm_structured: bool = True) -> None:
        self.engine = engine
        # Requests between add_request's entry and their queueing (tokenising on the text
        # thread): a step does not start for up to `add_grace` s while one is, so that a
        # request that arrived between steps makes the next step instead of waiting for a
        # whole one (on the priority-flood preset 1 in 5 urgent requests lost a ~40 ms step so).
        self._adding = 0
        self._added = asyncio.Event()
        self._add_grace = add_grace
        self._thread = thread or _engine_thread()
        self._text = concurrent.futures.ThreadPoolExecutor(
            max_workers=text_workers, thread_name_prefix="iterserve-text")
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._accepting = True
        self._idle_sleep = idle_sleep
        self._counter = 0
        self._counter_lock = threading.Lock()
        if scheduling_policy is None:
            cfg = engine.scheduler_config
            scheduling_policy = cfg.scheduling_policy if cfg is not None else "fcfs"
        self.scheduling_policy = str(getattr(scheduling_policy, "value", scheduling_policy))
        self.debug_check_consistency = debug_check_consistency
        self.warm_structured = warm_structured
        self._warm_thread: threading.Thread | None = None
        self._structured_compiler: Any = None
        self.num_health_checks = 0
        self.num_requests_added = 0                 # accepted by the engine, ever
        self._max_token_chars: int | None = None
        # the most recent violations seen (the tests read it); bounded like every other ring
        self.health_violations: collections.deque[str] = collections.deque(maxlen=1000)

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
        engine_kw = {k: kw.pop(k) for k in ("stat_loggers",) if k in kw}
        engine = thread.submit(LLMEngine.from_engine_args, args, **engine_kw).result()
        kw.setdefault("scheduling_policy", getattr(args, "scheduling_policy", None))
        return cls(engine, thread=thread, **kw)

    # --- what the server reads ------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def fatal_error(self) -> str | None:
        """Why the engine can serve nothing more (a tensor-parallel rank died), or None."""
        return self.engine.fatal_error()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_logprobs(self) -> int:
        return self.engine.max_logprobs

    @property
    def pooler_config(self) -> Any:
        """model.pooler.PoolerConfig when the model is served as an embedding model."""
        return self.engine.pooler_config

    async def encode(self, prompt: str | Sequence[int], params: PoolingParams | None = None,
                     request_id: str | None = None, **kw: Any) -> RequestOutput:
        """A pooling request's final output (its `embedding`); validation errors raise."""
        stream = await self.generate(prompt, params or PoolingParams(), request_id, **kw)
        final = None
        async for out in stream:
            final = out
        return final

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def is_closed(self) -> bool:
        """True once shutdown began: no new request is accepted."""
        return self._closed or not self._accepting

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def add_stat_logger(self, stat_logger: Any, *,
                        per_replica: Callable[[str, str], Any] | None = None) -> None:
        """`stat_logger.log(StepStats)` after every step. `per_replica(model_name, replica)`
        makes the logger of one replica's own series, for an engine that serves through
        replicas (replicas/pool.py); one engine has none, so it does not call it."""
        self.engine.stat_loggers.append(stat_logger)

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

    async def run_text_work(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run CPU-bound text work (tokenising, template rendering) off the event loop and
        off the engine thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._text, lambda: fn(*args, **kw))

    async def scheduler_stats(self) -> Any:
        """The scheduler's SchedulerStats snapshot, read on the engine thread."""
        return await self.run_in_engine(self.engine.scheduler_stats)

    async def stats(self) -> dict[str, Any]:
        return await self.run_in_engine(self.engine.stats)

    async def get_trace(self, request_id: str) -> dict[str, Any] | None:
        return await self.run_in_engine(self.engine.get_trace, request_id)

    # --- text -----------------------------------------------------------------------------
    def max_text_chars(self) -> int | None:
        """No text longer than this can tokenise to max_model_len tokens or fewer: a token
        covers at most its vocabulary entry's length in characters (byte-level entries count
        bytes, which bounds characters), times 4 for normalizers that merge characters."""
        if self._max_token_chars is None:
            try:
                self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=0)
            except Exception:           # a tokenizer without a vocabulary: no bound
                self._max_token_chars = 0
        return self.max_model_len * self._max_token_chars * 4 or None

    def _encode(self, text: str, add_special_tokens: bool, limit: int | None) -> list[int]:
        bound = self.max_text_chars()
        if bound is not None and len(text) > bound:
            raise PromptTooLongError(
                f"the text has {len(text)} characters; no text longer than {bound} characters "
                f"fits in this model's maximum context length of {self.max_model_len} tokens",
                "prompt")
        tok = self.tokenizer
        backend = getattr(tok, "backend", None)
        if backend is None or not hasattr(backend, "encode_batch"):
            ids = tok.encode(text, add_special_tokens=add_special_tokens)
        else:
            # encode_batch releases the GIL; the count is known before the id list is built.
            enc = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            if limit is not None and len(enc) > limit:
                raise PromptTooLongError(
                    f"the prompt has at least {len(enc)} tokens, but this model's maximum "
                    f"context length is {self.max_model_len} tokens (prompt and output "
                    "together)", "prompt")
            ids = enc.ids
            # The same BOS rule as Tokenizer.encode (tests/server check they agree).
            bos = getattr(tok, "bos_token_id", None)
            if add_special_tokens and getattr(tok, "add_bos_token", False) and bos is not None \
                    and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        if limit is not None and len(ids) > limit:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, but this model's maximum context length "
                f"is {self.max_model_len} tokens (prompt and output together)", "prompt")
        return ids

    async def tokenize(self, text: str, *, add_special_tokens: bool = True,
                       limit: int | None = None) -> list[int]:
        """Token ids of `text`, computed off the event loop; PromptTooLongError as soon as
        the count passes `limit`."""
        return await self.run_text_work(self._encode, text, add_special_tokens, limit)

    async def render_chat(self, messages: list[dict[str, Any]], *,
                          add_generation_prompt: bool = True) -> str:
        """The chat template's text for `messages`, rendered off the event loop."""
        return await self.run_text_work(self.tokenizer.apply_chat_template, messages,
                                        add_generation_prompt=add_generation_prompt)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self.run_text_work(self.tokenizer.decode, list(token_ids),
                                        skip_special_tokens=False)

    # --- the loop -------------------------------------------------------------------------
    def start(self) -> None:
        if self.is_running:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_task = self._loop.create_task(self._run_loop(), name="iterserve-engine-loop")
        self.warm_structured_outputs()

    def warm_structured_outputs(self) -> None:
        """Build the grammar compiler and compile, mask and apply one small grammar, on a
        background thread, once (`warm_structured=False` skips it). Why: the first
        constrained request after start otherwise paid it (~1 s to read a 49,152-token
        vocabulary into llguidance, plus first-call costs), and on the engine thread that
        froze every stream for 2.4-3.4 s."""
        if not self.warm_structured or self._warm_thread is not None:
            return

        def warm() -> None:
            try:
                seconds = self.engine.structured_compiler.warm()
                logger.info("structured outputs ready (compiler warmed in %.2f s)", seconds)
            except Exception as e:          # e.g. a tokenizer llguidance cannot read
                logger.info("structured outputs not warmed: %s", e)

        from iterserve.structured.workers import lower_priority

        def run() -> None:
            lower_priority(5)           # start-up work: never ahead of a step
            warm()

        self._warm_thread = threading.Thread(target=run, name="iterserve-warm", daemon=True)
        self._warm_thread.start()

    async def _compile_constraint(self, params: SamplingParams) -> Any:
        """The request's grammar, compiled on the compiler's worker threads while the event
        loop and the engine thread go on (None when unconstrained). Raises the 400s
        (StructuredOutputsError: a limit, a bad constraint, the time budget)."""
        so = getattr(params, "structured_outputs", None)
        if so is None:
            return None
        compiler = self._structured_compiler
        if compiler is None:            # built once (~1 s for a big vocabulary): off the loop
            compiler = await self.run_text_work(lambda: self.engine.structured_compiler)
            self._structured_compiler = compiler
        return await compiler.compile_async(so)

    def _check_health(self) -> list[str]:
        """On the engine thread: LLMEngine.check_health(), logged (never raises)."""
        fn = self.engine.check_health
        self.num_health_checks += 1
        try:
            problems = list(fn() or [])
        except Exception:
            logger.exception("the consistency check itself failed")
            return []
        for p in problems:
            logger.error("consistency violation: %s", p)
        self.health_violations.extend(problems)
        return problems

    # Off by default: pipelined, an abort (a consumer that left) lands behind the step
    # already running, so its blocks are freed one step later (tests/engine/test_async_engine
    # holds the loop to "within one step"); benchmarks/step_gap.py measures what it buys.
    pipeline_steps = False

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        busy = False
        pending: asyncio.Future | None = None      # the next step, already on the engine thread
        while not self._closed or pending is not None:
            if pending is None:
                if not self.engine.has_unfinished_requests():
                    if busy:                    # just went idle: check the books once
                        busy = False
                        if await loop.run_in_executor(self._thread, self._check_health):
                            continue            # ended requests emit their outputs next step
                    # Re-read _closed after the clear: shutdown may have set _closed and
                    # _work while the health check ran, and its wake-up is cleared here.
                    self._work.clear()
                    if not self._closed and not self.engine.has_unfinished_requests():
                        await self._work.wait()
                    continue
                busy = True
                if self._adding and self._add_grace > 0:
                    self._added.clear()
                    try:
                        await asyncio.wait_for(self._added.wait(), self._add_grace)
                    except asyncio.TimeoutError:
                        pass
                pending = loop.run_in_executor(self._thread, self._step)
            try:
                outputs = await pending
            except Exception as e:           # the engine itself broke: fail everyone, go on
                pending = None
                logger.exception("engine step failed")
                for rid, q in list(self._streams.items()):
                    q.put_nowait(e)
                    self._thread.submit(self.engine.abort_request, rid)
                await asyncio.sleep(0.01)
                continue
            pending = None
            # Pipelined (opt-in): the next step is on the engine thread before this one's outputs go
            # to the streams, so the streams' Python (one SSE chunk each) runs during the
            # forward pass instead of idling the engine between steps (benchmarks/step_gap.py
            # measured that gap). Outputs are snapshots (output_processor), so the running
            # step cannot change what a stream reads; aborts queue behind it as before.
            if self.pipeline_steps and outputs and not self._closed \
                    and self.engine.has_unfinished_requests():
                pending = loop.run_in_executor(self._thread, self._step)
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

    def _step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        if self.debug_check_consistency:
            self._check_health()
        return outputs

    # --- the API --------------------------------------------------------------------------
    def _add_on_thread(self, request_id: str, prompt: Any, params: SamplingParams,
                       kw: dict[str, Any]) -> list[int]:
        try:
            return self.engine.add_request(request_id, prompt, params, **kw)
        except IterserveError:
            raise
        except ValueError as e:
            if getattr(e, "param", None) is not None:   # SamplingParamsError: already precise
                raise
            # The scheduler's "this request can never fit" (core raises plain ValueErrors
            # from add_request by contract): the request's fault.
            raise InvalidRequestError(str(e), "prompt") from e

    async def add_request(self, request_id: str, prompt: str | Sequence[int],
                          params: SamplingParams, **kw: Any
                          ) -> tuple[list[int], asyncio.Queue]:
        """Validate and queue a request; raises ClientErrors / QueueFullError (busy) /
        EngineDeadError (shutting down). A text prompt is tokenised off the event loop."""
        if not self._accepting or self._closed:
            raise EngineDeadError("the server is shutting down")
        self._adding += 1
        try:
            return await self._add_request(request_id, prompt, params, **kw)
        finally:
            self._adding -= 1
            self._added.set()

    async def _add_request(self, request_id: str, prompt: str | Sequence[int],
                           params: SamplingParams, **kw: Any
                           ) -> tuple[list[int], asyncio.Queue]:
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("the prompt is empty", "prompt")
            kw.setdefault("prompt_text", prompt)
            prompt = await self.tokenize(prompt, limit=self.max_model_len)
        elif len(prompt) > self.max_model_len or (     # before the engine walks every id
                len(prompt) == self.max_model_len and not isinstance(params, PoolingParams)):
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} tokens, but this model's maximum context "
                f"length is {self.max_model_len} tokens (prompt and output together)",
                "prompt")
        self.start()
        grammar = await self._compile_constraint(params)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        try:
            # Pinned: the engine thread's add finds this grammar whatever the cache did
            # meanwhile, so it never compiles (never blocks a step) itself.
            with (self._structured_compiler.pinned(grammar) if grammar is not None
                  else contextlib.nullcontext()):
                prompt_ids = await self.run_in_engine(self._add_on_thread, request_id, prompt,
                                                      params, kw)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self.num_requests_added += 1
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

    async def shutdown(self, *, abort_in_flight: bool = True, drain_timeout: float = 0.0,
                       abort_grace: float = 0.5) -> None:
        """Stop accepting, let in-flight requests finish for `drain_timeout` seconds, then
        abort the rest *through the engine*, so each stream gets its final output with
        finish_reason "abort" (and the server its usage chunk and `[DONE]`); a stream still
        open `abort_grace` seconds later gets EngineDeadError. Bounded: it returns within
        about drain_timeout + abort_grace + one step."""
        if self._closed:
            return
        self._accepting = False
        loop = asyncio.get_running_loop()
        if drain_timeout > 0 and self.is_running:
            deadline = loop.time() + drain_timeout
            while self._streams and loop.time() < deadline:
                await asyncio.sleep(0.02)
        if abort_in_flight and self._streams:
            if self.is_running:
                for rid in list(self._streams):
                    self._thread.submit(self.engine.abort_request, rid)
                self._work.set()
                deadline = loop.time() + abort_grace
                while self._streams and loop.time() < deadline:
                    await asyncio.sleep(0.01)
            for rid in list(self._streams):
                q = self._streams.pop(rid)
                self._thread.submit(self.engine.abort_request, rid)
                q.put_nowait(EngineDeadError("the server is shutting down"))
        self._closed = True
        self._work.set()
        if self._loop_task is not None:
            try:
                await asyncio.wait_for(self._loop_task, timeout=5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._loop_task.cancel()
        # Flush the aborts so blocks are freed, then stop the threads.
        await loop.run_in_executor(None, self._thread.shutdown, True)
        # Then the executor's own processes (tensor-parallel ranks), if it has any.
        await loop.run_in_executor(None, self.engine.shutdown)
        self._text.shutdown(wait=False, cancel_futures=True)
