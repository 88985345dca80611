"""LLMEngine: one `step()` turns the scheduler's plan into tokens, text and outputs.

    add_request -> InputProcessor (tokenise, validate, fan out n) -> scheduler queue
    step:  scheduler.schedule -> executor.execute -> scheduler.update_from_output
           -> OutputProcessor (detokenise, stop strings, logprobs, RequestOutputs)
           -> Tracer (traces, step history, stat loggers)

Each job has its own module (input_processor, output_processor, tracing, builder); this
class only wires them and decides the order, which matters in two places: a sequence the
executor failed on is ended in the scheduler *before* update_from_output (so its chunk is
skipped), and a sequence a stop string ended is ended right after it.

It is single-threaded by design: AsyncEngine calls every method from one worker thread, so
no lock is needed here.

Failure isolation: an exception while handling one sequence's token ends only that sequence
(finish reason "error"); an executor failure ends the requests of that step and the engine
keeps serving the others; `check_health()` ends the requests a scheduler consistency check
names.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Sequence

from iterserve.core.request import FinishReason, PoolingParams, SamplingParams
from iterserve.core.scheduler import SchedulerStats
from iterserve.core.scheduler_output import SampleResult, SchedulerOutput
from iterserve.engine.builder import build_engine_parts
from iterserve.engine.input_processor import InputProcessor
from iterserve.engine.interfaces import EngineScheduler, Executor
from iterserve.engine.metrics import StatLogger, StepStats
from iterserve.engine.output_processor import OutputProcessor
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.tracing import Tracer
from iterserve.errors import DuplicateRequestIdError

__all__ = ["LLMEngine", "Executor", "EngineScheduler"]

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        scheduler: EngineScheduler,
        executor: Executor,
        tokenizer: Any,
        *,
        model_name: str = "model",
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
        max_finished_requests: int = 1000,
        step_history_len: int = 300,
        stat_loggers: Sequence[StatLogger] = (),
        detokenizer_factory: Callable[..., Any] | None = None,
        max_logprobs: int = -1,
        structured_outputs_config: dict[str, Any] | None = None,
        pooler_config: Any = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.clock = clock
        self.input_processor = InputProcessor(
            tokenizer, vocab_size=vocab_size, max_model_len=max_model_len,
            eos_token_ids=eos_token_ids, clock=clock, max_logprobs=max_logprobs,
            structured_outputs_config=structured_outputs_config, pooler_config=pooler_config)
        self.output_processor = OutputProcessor(tokenizer, clock=clock,
                                                detokenizer_factory=detokenizer_factory)
        self.tracer = Tracer(model_name=model_name, clock=clock,
                             max_finished_requests=max_finished_requests,
                             step_history_len=step_history_len, stat_loggers=stat_loggers)
        self.num_steps = 0
        self.num_executor_failures = 0
        # KV tiers (core/kv_tiers.py): the executor's report on its tier ops goes back to
        # the block manager after each step; None when either side has no tiers.
        bm = getattr(scheduler, "block_manager", None)
        self._tier_bm = bm if getattr(bm, "tiers", None) is not None else None
        self._take_tier_feedback = getattr(executor, "take_kv_feedback", None) \
            if self._tier_bm is not None else None
        # Set by from_engine_args (None for an engine wired by hand, as in tests).
        self.loaded_model: Any = None
        self.scheduler_config: Any = None
        self.cache_config: Any = None

    @classmethod
    def from_engine_args(cls, args: Any, *, stat_loggers: Sequence[StatLogger] = ()) -> "LLMEngine":
        """Load the model, size the KV pool and build scheduler + runner (engine/builder.py)."""
        p = build_engine_parts(args)
        engine = cls(p.scheduler, p.executor, p.tokenizer, model_name=p.model_name,
                     max_model_len=p.max_model_len, vocab_size=p.vocab_size,
                     eos_token_ids=p.eos_token_ids, clock=p.clock,
                     max_finished_requests=args.max_finished_requests,
                     step_history_len=args.step_history_len, stat_loggers=stat_loggers,
                     max_logprobs=args.max_logprobs,
                     structured_outputs_config=args.structured_outputs_config,
                     pooler_config=p.pooler_config)
        engine.loaded_model = p.loaded_model
        engine.cache_config = p.cache_config
        engine.scheduler_config = p.scheduler_config
        return engine

    # --- public attributes ---------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.tracer.model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        self.tracer.model_name = name

    @property
    def max_model_len(self) -> int:
        return self.input_processor.max_model_len

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for (--max-logprobs)."""
        return self.input_processor.max_logprobs

    @property
    def vocab_size(self) -> int:
        return self.input_processor.vocab_size

    @property
    def pooler_config(self) -> Any:
        """How the model pools (model.pooler.PoolerConfig) when it is served as an
        embedding model (--runner pooling); None for text generation."""
        return self.input_processor.pooler_config

    @property
    def structured_compiler(self) -> Any:
        """The grammar compiler (structured.backend; built on first use). The server can
        `await engine.structured_compiler.compile_async(params)` before add_request so the
        compile happens off the engine thread; add_request then finds it cached."""
        return self.input_processor.structured_compiler

    @property
    def eos_token_ids(self) -> list[int]:
        return self.input_processor.eos_token_ids

    @property
    def stat_loggers(self) -> list[StatLogger]:
        """The live list: append a logger to start feeding it StepStats."""
        return self.tracer.stat_loggers

    @stat_loggers.setter
    def stat_loggers(self, loggers: Sequence[StatLogger]) -> None:
        self.tracer.stat_loggers = list(loggers)

    # --- requests ------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True
                        ) -> list[int]:
        """Token ids of `prompt`, validated against the vocabulary (no length checks)."""
        return self.input_processor.tokenize_prompt(prompt, add_special_tokens=add_special_tokens)

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int) -> None:
        self.input_processor.check_lengths(num_prompt_tokens, max_tokens)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        timeout: float | None = None,
        prompt_text: str | None = None,
    ) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises InvalidRequestError /
        SamplingParamsError (bad request) or the scheduler's QueueFullError (busy)."""
        self.input_processor.check_request_id(request_id)
        if self.output_processor.has_request(request_id):
            raise DuplicateRequestIdError(f"request {request_id!r} is already being served")
        processed = self.input_processor.process(
            request_id, prompt, params, priority=priority, arrival_time=arrival_time,
            timeout=timeout, prompt_text=prompt_text)
        self.output_processor.add_request(processed)
        added: list[str] = []
        try:
            for req in processed.requests:
                self.scheduler.add_request(req)
                added.append(req.request_id)
        except BaseException:
            for sid in added:            # all n or none
                self.scheduler.finish_request(sid, FinishReason.ABORT)
            self.output_processor.discard(request_id)
            raise
        return processed.prompt_token_ids

    def abort_request(self, request_id: str) -> bool:
        """End a request (all its sequences) with finish reason "abort" and free its blocks
        now; its final output comes with the next step(). False if it is not live."""
        ids = self.output_processor.abort(request_id)
        if ids is None:
            return False
        self._end_in_scheduler((sid, FinishReason.ABORT) for sid in ids)
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests to serve or outputs to emit, or KV tier writes the last step left for
        the next one (so an engine that goes idle still writes its last blocks through)."""
        return bool(self.output_processor.requests) or self.output_processor.has_unemitted_outputs() \
            or (self._tier_bm is not None and self._tier_bm.has_pending_kv_ops)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched_out: SchedulerOutput = self.scheduler.schedule()
        stats = StepStats(step=sched_out.step, time=self.clock(),
                          num_batched_tokens=sched_out.num_batched_tokens,
                          num_preemptions=sched_out.num_preemptions)
        # Ended outside a forward pass (timeouts, aborts done by the scheduler).
        self.output_processor.end_by_scheduler(sched_out.ended_req_ids, FinishReason.ABORT)

        if self.output_processor.has_constrained and sched_out.num_scheduled_tokens:
            sched_out.grammar_bitmask = self._grammar_bitmask(sched_out)
        results = self._execute(sched_out)
        self._sit_out(sched_out)
        if self._take_tier_feedback is not None:  # failed tier reads / writes, their costs
            feedback = self._take_tier_feedback()
            if feedback is not None:
                self._tier_bm.apply_tier_feedback(feedback)
        sampled = self.output_processor.live_tokens(results)
        if self.input_processor.pooler_config is not None:   # pooling requests' vectors
            self.output_processor.process_pooled(results, stats)
        # Always called, even for an empty or failed step: it advances the step counter, and
        # skips the chunks of requests ended above.
        finished = self.scheduler.update_from_output(sched_out, sampled)

        stopped = self.output_processor.process_tokens(sampled, results, stats)
        self._end_in_scheduler(stopped)           # stop strings, per-sequence failures
        if self.output_processor.has_constrained and getattr(self.scheduler, "spec", None):
            # speculative drafts of constrained sequences: only what their grammar takes
            for sid, n in self.output_processor.draft_limits().items():
                self.scheduler.limit_drafts(sid, n)
        self.output_processor.end_by_scheduler([r.request_id for r in finished],
                                               FinishReason.STOP)
        outputs, retired = self.output_processor.make_outputs(stats)

        self.tracer.retire(retired)
        self.tracer.record_step(stats, self.scheduler.stats(),
                                active=bool(sched_out.num_scheduled_tokens
                                            or sched_out.ended_req_ids))
        self.num_steps += 1
        return outputs

    def _grammar_bitmask(self, sched_out: SchedulerOutput) -> Any:
        """The constrained rows' masks; a failure ends those sequences, not the step."""
        try:
            return self.output_processor.grammar_bitmask(sched_out)
        except Exception as e:
            logger.exception("filling the grammar bitmask failed in step %d", sched_out.step)
            rids = [rid for rid in sched_out.num_scheduled_tokens
                    if self.output_processor.is_constrained(rid)]
            self._end_in_scheduler(self.output_processor.fail(rids, f"grammar error: {e}"))
            return None

    @staticmethod
    def _sit_out(sched_out: SchedulerOutput) -> None:
        """Constrained sequences whose grammar mask was not ready in time sampled nothing
        (structured/masks.py): their last scheduled token counts as not computed, so the
        scheduler schedules it again (its KV is rewritten with the same values) instead of
        expecting a sampled token. The one hook into the scheduler's books, kept here."""
        deferred = getattr(sched_out.grammar_bitmask, "deferred", None)
        if not deferred:
            return
        counts = sched_out.num_scheduled_tokens
        for rid in deferred:
            if counts.get(rid, 0) > 0:
                counts[rid] -= 1

    def _execute(self, sched_out: SchedulerOutput) -> dict[str, SampleResult]:
        """The executor's tokens; on failure, the step's sequences end with "error" (in the
        scheduler too, before update_from_output) and the engine goes on."""
        if sched_out.is_empty:
            return {}
        try:
            return self.executor.execute(sched_out) or {}
        except Exception as e:
            self.num_executor_failures += 1
            logger.exception("executor failed in step %d", sched_out.step)
            rids = list(sched_out.num_scheduled_tokens)
            self._end_in_scheduler(self.output_processor.fail(rids, f"executor error: {e}"))
            return {}

    def _end_in_scheduler(self, to_end: Iterable[tuple]) -> None:
        for sid, reason, *keep in to_end:     # idempotent: no-op if already ended
            if keep:                          # a stop inside a verification's tokens
                self.scheduler.finish_request(sid, reason, num_output_tokens=keep[0])
            else:
                self.scheduler.finish_request(sid, reason)

    # --- health --------------------------------------------------------------------------
    def check_health(self) -> list[str]:
        """Run the scheduler's consistency check; log each violation and end the requests it
        names with finish reason "error" (their blocks freed, their outputs in the next
        step). Returns the violations as messages ([] when healthy). Cheap enough to run
        whenever the engine goes idle (AsyncEngine does)."""
        check = getattr(self.scheduler, "consistency_violations", None)
        if check is None:
            return []
        try:
            violations = check()
        except Exception as e:          # the check itself broke: report it, end nobody
            logger.exception("scheduler consistency check failed")
            return [f"the consistency check failed: {type(e).__name__}: {e}"]
        messages = []
        for rid, message in violations:
            text = f"request {rid}: {message}" if rid is not None else message
            logger.error("scheduler consistency violation: %s", text)
            messages.append(text)
            if rid is None:
                continue
            try:
                # A scheduler request the engine does not know is ended all the same.
                self._end_in_scheduler(self.output_processor.fail(
                    [rid], f"internal error: scheduler state inconsistent ({message})")
                    or [(rid, FinishReason.ERROR)])
            except Exception:
                logger.exception("could not end request %s after a consistency violation", rid)
        return messages

    def fatal_error(self) -> str | None:
        """Why this engine can serve nothing more (a tensor-parallel rank died), or None.
        Only an executor with processes of its own can fail this way; the in-process
        ModelRunner has no such attribute."""
        return getattr(self.executor, "fatal_error", None)

    def shutdown(self) -> None:
        """Hand the executor the KV tier writes still pending (one step), then stop it: its
        processes (tensor-parallel ranks), its disk tier's writer (which finishes them)."""
        if self._tier_bm is not None and self._tier_bm.has_pending_kv_ops \
                and not self.output_processor.requests:
            try:
                self.step()
            except Exception:
                logger.exception("writing the KV tiers' last blocks failed")
        stop = getattr(self.executor, "shutdown", None)
        if stop is not None:
            stop()

    # --- observability -------------------------------------------------------------------
    def get_trace(self, request_id: str) -> dict[str, Any] | None:
        """Lifecycle events of a live or recently finished request (None if unknown)."""
        return self.tracer.get_trace(request_id, self.output_processor.requests)

    def recent_traces(self, limit: int = 20) -> list[dict[str, Any]]:
        """The `limit` most recent requests, live ones first (newest first)."""
        return self.tracer.recent_traces(self.output_processor.requests, limit)

    @property
    def history(self):
        """The recent steps that did something (the live view's chart)."""
        return self.tracer.history

    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler's counters now (running, waiting, swapped, KV usage, preemptions)."""
        return self.scheduler.stats()

    def stats(self) -> dict[str, Any]:
        """The live view's snapshot (GET /v1/engine/stats), with the runner's memory plan
        (weights by encoding, native vs reference linears, KV size, planned peak) when the
        executor has one."""
        snap = self.tracer.snapshot(self.scheduler.stats(), self.output_processor.requests)
        plan = getattr(self.executor, "memory_plan", None)
        if plan is not None:
            snap["memory"] = plan
        if getattr(self.scheduler, "slo", None) is not None:    # refused, held, rate, fit
            snap["slo"] = self.scheduler.slo.stats()
        if self._tier_bm is not None:          # what each KV tier holds, hits, costs, I/O
            tiers = self._tier_bm.tier_stats()
            store = getattr(self.executor, "tier_store", None)
            if store is not None:
                tiers["store"] = store.stats()
            snap["kv_tiers"] = tiers
        return snap
