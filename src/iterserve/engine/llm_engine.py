"""LLMEngine: one `step()` turns the scheduler's plan into tokens, text and outputs.

    schedule -> executor.execute -> scheduler.update_from_output
             -> detokenise + stop strings -> RequestOutputs for what advanced or finished

The engine owns what the torch-free scheduler must not know: text. It tokenises and
validates prompts (precise ValueErrors, see engine/errors.py), keeps one incremental
detokenizer per sequence, ends a sequence whose text hit a stop string with
`scheduler.finish_request(id, STOP)`, and fans a request with `n > 1` out into n scheduler
requests (ids `<id>-n<i>`, seed + i when seeded) whose outputs it gathers back.

It is single-threaded by design: AsyncEngine calls every method from one worker thread, so
no lock is needed here.

Failure isolation: an exception while handling one sequence's token ends only that sequence
(finish reason "error"); an executor failure ends the requests of that step and the engine
keeps serving the others.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

from iterserve.core.request import FinishReason, Request, SamplingParams
from iterserve.core.scheduler_output import SampleResult, SchedulerOutput
from iterserve.engine.errors import (
    DuplicateRequestIdError, EmptyPromptError, InvalidRequestError, MaxTokensTooLargeError,
    PromptTooLongError, TokenIdOutOfRangeError)
from iterserve.engine.metrics import RequestMetrics, StatLogger, StepStats, merge_metrics
from iterserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)


class Executor(Protocol):
    def execute(self, output: SchedulerOutput) -> dict[str, SampleResult]: ...


@dataclass(eq=False)
class _Sequence:
    """One of a request's n sequences: a scheduler Request plus its text state."""

    index: int
    request: Request
    detokenizer: Any
    logprobs: list[TokenLogprob] | None
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    reported: bool = False          # its finish was emitted in an output
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)
    touched: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _Group:
    """One user request (the unit of outputs and traces)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    arrival_wall_time: float
    seqs: list[_Sequence] = field(default_factory=list)
    error: str | None = None
    counted_prompt: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    def __init__(
        self,
        scheduler: Any,
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
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.clock = clock
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        if detokenizer_factory is None:
            from iterserve.model.detokenizer import IncrementalDetokenizer
            detokenizer_factory = IncrementalDetokenizer
        self._detokenizer_factory = detokenizer_factory
        self._groups: dict[str, _Group] = {}            # live requests
        self._seqs: dict[str, tuple[_Group, _Sequence]] = {}   # scheduler id -> live sequence
        self._finished: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._max_finished = max_finished_requests
        self._pending: dict[str, _Group] = {}           # finished outside step(): emit next step
        self.history: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=step_history_len)
        self.num_steps = 0
        self.num_executor_failures = 0

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_engine_args(cls, args: Any, *, stat_loggers: Sequence[StatLogger] = ()) -> "LLMEngine":
        """Load the model, size the KV pool and build scheduler + runner from EngineArgs."""
        import torch

        from iterserve.core.scheduler import Scheduler
        from iterserve.model.loader import load_model
        from iterserve.model.runner import ModelRunner

        torch.manual_seed(args.seed)
        loaded = load_model(args.model, dtype=args.dtype, device=args.device,
                            kv_cache_dtype=args.kv_cache_dtype)
        cfg = loaded.config
        sched_cfg = args.create_scheduler_config(cfg.max_position_embeddings)
        bytes_per_block = ModelRunner.kv_cache_bytes_per_block(cfg, args.block_size)
        cache_cfg = args.create_cache_config(bytes_per_block)
        runner = ModelRunner(loaded, num_blocks=cache_cfg.num_blocks,
                             block_size=cache_cfg.block_size,
                             num_swap_blocks=cache_cfg.num_swap_blocks)
        clock = time.monotonic
        scheduler = Scheduler(sched_cfg, cache_cfg, clock=clock)
        eos = set(cfg.eos_token_ids or ()) | set(getattr(loaded.tokenizer, "eos_token_ids", ()) or ())
        engine = cls(scheduler, runner, loaded.tokenizer,
                     model_name=args.served_model_name or loaded.name,
                     max_model_len=sched_cfg.max_model_len, vocab_size=cfg.vocab_size,
                     eos_token_ids=eos, clock=clock,
                     max_finished_requests=args.max_finished_requests,
                     step_history_len=args.step_history_len, stat_loggers=stat_loggers)
        engine.loaded_model = loaded
        engine.cache_config = cache_cfg
        engine.scheduler_config = sched_cfg
        return engine

    # --- requests -----------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True
                        ) -> list[int]:
        """Token ids of `prompt`, validated against the vocabulary (no length checks)."""
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("the prompt is empty", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt)
        if not ids:
            raise EmptyPromptError("the prompt is empty (no token ids)", "prompt")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise TokenIdOutOfRangeError(
                    f"prompt token {i} is {t!r}, not an integer token id", "prompt")
            if not 0 <= t < self.vocab_size:
                raise TokenIdOutOfRangeError(
                    f"prompt token id {t} (position {i}) is outside the vocabulary "
                    f"[0, {self.vocab_size})", "prompt")
        return ids

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_prompt_tokens} tokens, but this model's maximum context "
                f"length is {self.max_model_len} tokens (prompt and output together)", "prompt")
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise MaxTokensTooLargeError(
                f"this model's maximum context length is {self.max_model_len} tokens; you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} in the completion)", "max_tokens")

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        timeout: float | None = None,
        prompt_text: str | None = None,
    ) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises InvalidRequestError /
        SamplingParamsError (bad request) or the scheduler's QueueFullError (busy)."""
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        if request_id in self._groups or request_id in self._pending:
            raise DuplicateRequestIdError(f"request {request_id!r} is already being served")
        params.validate()
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
        prompt_ids = self.tokenize_prompt(prompt)
        self.check_lengths(len(prompt_ids), params.max_tokens)
        now = self.clock() if arrival_time is None else arrival_time
        deadline = now + timeout if timeout is not None else None

        group = _Group(request_id, prompt if isinstance(prompt, str) else prompt_text,
                       prompt_ids, params, priority, now, time.time())
        added: list[str] = []
        try:
            for i in range(params.n):
                seq_params = self._sequence_params(params, i)
                sid = request_id if params.n == 1 else f"{request_id}-n{i}"
                req = Request(sid, prompt_ids, seq_params, priority=priority, arrival_time=now,
                              eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
                              deadline=deadline, user_data=request_id)
                detok = self._detokenizer_factory(
                    self.tokenizer, prompt_ids, skip_special_tokens=seq_params.skip_special_tokens,
                    stop=tuple(seq_params.stop))
                seq = _Sequence(i, req, detok, [] if seq_params.logprobs is not None else None)
                self.scheduler.add_request(req)
                added.append(sid)
                group.seqs.append(seq)
                self._seqs[sid] = (group, seq)
        except BaseException:
            for sid in added:            # all n or none
                self.scheduler.finish_request(sid, FinishReason.ABORT)
                self._seqs.pop(sid, None)
            raise
        self._groups[request_id] = group
        return prompt_ids

    def _sequence_params(self, params: SamplingParams, i: int) -> SamplingParams:
        changes: dict[str, Any] = {"n": 1}
        if params.seed is not None:
            changes["seed"] = params.seed + i
        if not params.ignore_eos and len(self.eos_token_ids) > 1:
            # Request carries one eos id; the model's other eos ids stop it the same way.
            extra = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
            changes["stop_token_ids"] = list(params.stop_token_ids) + extra
        changes["stop"] = list(params.stop)
        return dataclasses.replace(params, **changes)

    def abort_request(self, request_id: str) -> bool:
        """End a request (all its sequences) with finish reason "abort" and free its blocks
        now; its final output comes with the next step(). False if it is not live."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        for seq in group.seqs:
            if not seq.finished:
                self.scheduler.finish_request(seq.request.request_id, FinishReason.ABORT)
                seq.finish_reason = FinishReason.ABORT
                seq.touched = True
        self._pending[request_id] = group
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._pending)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched_out: SchedulerOutput = self.scheduler.schedule()
        stats = StepStats(step=sched_out.step, time=self.clock(),
                          num_batched_tokens=sched_out.num_batched_tokens,
                          num_preemptions=len(sched_out.preempted) + len(sched_out.swapped_out))
        touched: dict[str, _Group] = dict(self._pending)
        self._pending.clear()

        # Ended outside a forward pass (timeouts, aborts done by the scheduler).
        for req in sched_out.finished:
            self._end_from_scheduler(req, touched)

        results: dict[str, SampleResult] = {}
        if sched_out.chunks or sched_out.blocks_to_swap_in or sched_out.blocks_to_swap_out:
            try:
                results = self.executor.execute(sched_out) or {}
            except Exception as e:
                self.num_executor_failures += 1
                logger.exception("executor failed in step %d", sched_out.step)
                for chunk in sched_out.chunks:
                    self._fail(chunk.request.request_id, f"executor error: {e}", touched)
                results = {}

        sampled = {rid: r.token_id for rid, r in results.items()
                   if rid in self._seqs and not self._seqs[rid][1].finished}
        # Always called, even for an empty or failed step: it advances the step counter, and
        # skips the chunks of requests ended above.
        finished_now = self.scheduler.update_from_output(sched_out, sampled)
        finished_ids = {r.request_id: r for r in finished_now}

        for rid, token_id in sampled.items():
            group, seq = self._seqs[rid]
            try:
                self._on_token(group, seq, token_id, results[rid], stats)
            except Exception as e:
                logger.exception("request %s failed while handling its token", rid)
                self._fail(rid, f"{type(e).__name__}: {e}", touched)
            touched[group.request_id] = group

        for rid, req in finished_ids.items():
            entry = self._seqs.get(rid)
            if entry is None:
                continue
            group, seq = entry
            if not seq.finished:
                seq.finish_reason = req.finish_reason or FinishReason.STOP
                if seq.finish_reason is FinishReason.STOP and req.output_token_ids and \
                        req.output_token_ids[-1] in req.sampling_params.stop_token_ids:
                    seq.stop_reason = req.output_token_ids[-1]
                self._flush_text(seq)
            seq.touched = True
            touched[group.request_id] = group

        outputs = [self._make_output(g, stats) for g in touched.values()]
        self._record_step(sched_out, stats)
        return outputs

    def _on_token(self, group: _Group, seq: _Sequence, token_id: int, result: SampleResult,
                  stats: StepStats) -> None:
        req = seq.request
        seq.touched = True
        seq.delta_token_ids.append(token_id)
        stats.num_generation_tokens += 1
        if req.num_output_tokens == 1 and req.first_token_time is not None:
            stats.time_to_first_tokens.append(req.first_token_time - req.arrival_time)
            if not group.counted_prompt:
                group.counted_prompt = True
                stats.num_prompt_tokens += req.num_prompt_tokens
        elif len(req.token_times) >= 2:
            stats.inter_token_latencies.append(req.token_times[-1] - req.token_times[-2])
        if seq.logprobs is not None:
            lp = TokenLogprob(token_id, result.logprob, result.top_logprobs)
            seq.logprobs.append(lp)
            seq.delta_logprobs.append(lp)
        delta = seq.detokenizer.add(token_id)
        if delta.text:
            seq.text += delta.text
            seq.delta_text += delta.text
        if delta.stopped:
            seq.stop_reason = getattr(delta, "stop_string", None)
            if not req.is_finished:
                self.scheduler.finish_request(req.request_id, FinishReason.STOP)
            seq.finish_reason = FinishReason.STOP    # a stop string wins over "length"

    def _flush_text(self, seq: _Sequence) -> None:
        if seq.finish_reason is FinishReason.STOP and seq.stop_reason is not None and \
                isinstance(seq.stop_reason, str):
            return                          # text after a stop string is never shown
        rest = seq.detokenizer.flush()
        if rest:
            seq.text += rest
            seq.delta_text += rest
        if getattr(seq.detokenizer, "stopped", False) and seq.finish_reason is FinishReason.LENGTH:
            seq.finish_reason = FinishReason.STOP    # the held-back tail completed a stop string

    def _end_from_scheduler(self, req: Request, touched: dict[str, _Group]) -> None:
        entry = self._seqs.get(req.request_id)
        if entry is None:
            return
        group, seq = entry
        if not seq.finished:
            seq.finish_reason = req.finish_reason or FinishReason.ABORT
            self._flush_text(seq)
        seq.touched = True
        touched[group.request_id] = group

    def _fail(self, rid: str, message: str, touched: dict[str, _Group]) -> None:
        entry = self._seqs.get(rid)
        if entry is None:
            return
        group, seq = entry
        if not seq.request.is_finished:
            self.scheduler.finish_request(rid, FinishReason.ERROR)
        seq.finish_reason = FinishReason.ERROR
        seq.touched = True
        group.error = group.error or message
        touched[group.request_id] = group

    def _make_output(self, group: _Group, stats: StepStats) -> RequestOutput:
        now = self.clock()
        outs = []
        for seq in group.seqs:
            just_finished = seq.finished and not seq.reported
            metrics = RequestMetrics.from_request(seq.request, now) if seq.finished else None
            if just_finished:
                seq.reported = True
                stats.finished.append(metrics)
                stats.finish_reasons.append(seq.finish_reason.value)
            outs.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(seq.request.output_token_ids),
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason,
                delta_text=seq.delta_text, delta_token_ids=seq.delta_token_ids,
                delta_logprobs=seq.delta_logprobs if seq.logprobs is not None else None,
                finished_in_this_step=just_finished, metrics=metrics))
            seq.delta_text, seq.delta_token_ids, seq.delta_logprobs = "", [], []
            seq.touched = False
        finished = group.finished
        metrics = merge_metrics([RequestMetrics.from_request(s.request, now) for s in group.seqs])
        out = RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs,
                            finished=finished, metrics=metrics, error=group.error)
        if finished:
            self._retire(group)
        return out

    def _retire(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for seq in group.seqs:
            self._seqs.pop(seq.request.request_id, None)
        self._finished[group.request_id] = self._trace(group)
        self._finished.move_to_end(group.request_id)
        while len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)

    # --- observability ------------------------------------------------------------------
    def _trace(self, group: _Group) -> dict[str, Any]:
        now = self.clock()
        seq_traces = []
        for seq in group.seqs:
            t = seq.request.trace()
            for ev in t["events"]:
                ev["t"] = ev["time"] - group.arrival_time
            if seq.finish_reason is not None:
                t["finish_reason"] = seq.finish_reason.value
            t["index"] = seq.index
            t["metrics"] = RequestMetrics.from_request(seq.request, now).to_dict()
            seq_traces.append(t)
        trace = dict(seq_traces[0])
        trace["request_id"] = group.request_id
        trace["model"] = self.model_name
        trace["arrival_wall_time"] = group.arrival_wall_time
        trace["n"] = len(group.seqs)
        trace["finished"] = group.finished
        if group.error:
            trace["error"] = group.error
        if len(group.seqs) > 1:
            trace["output_tokens"] = sum(t["output_tokens"] for t in seq_traces)
            trace["num_preemptions"] = sum(t["num_preemptions"] for t in seq_traces)
            trace["metrics"] = merge_metrics(
                [RequestMetrics.from_request(s.request, now) for s in group.seqs]).to_dict()
            trace["sequences"] = seq_traces
        return trace

    def get_trace(self, request_id: str) -> dict[str, Any] | None:
        """Lifecycle events of a live or recently finished request (None if unknown)."""
        group = self._groups.get(request_id)
        if group is not None:
            return self._trace(group)
        return self._finished.get(request_id)

    def recent_traces(self, limit: int = 20) -> list[dict[str, Any]]:
        """The `limit` most recent requests, live ones first (newest first)."""
        live = [self._trace(g) for g in reversed(list(self._groups.values()))][:limit]
        done = [t for _, t in zip(range(limit - len(live)), reversed(self._finished.values()))]
        return live + done

    def _record_step(self, sched_out: SchedulerOutput, stats: StepStats) -> None:
        s = self.scheduler.stats()
        stats.num_running, stats.num_waiting = s.num_running, s.num_waiting
        stats.num_swapped, stats.kv_cache_usage = s.num_swapped, s.kv_usage
        self.num_steps += 1
        if sched_out.chunks or sched_out.finished:
            self.history.append({
                "step": sched_out.step, "time": time.time(),
                "num_batched_tokens": sched_out.num_batched_tokens,
                "num_running": s.num_running, "num_waiting": s.num_waiting,
                "num_swapped": s.num_swapped, "kv_cache_usage": s.kv_usage,
            })
        for sl in self.stat_loggers:
            try:
                sl.log(stats)
            except Exception:
                logger.exception("stat logger %r failed", sl)

    def stats(self) -> dict[str, Any]:
        """The live view's snapshot (GET /v1/engine/stats)."""
        s = self.scheduler.stats()
        return {
            "model": self.model_name,
            "step": s.step,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_swapped": s.num_swapped,
            "kv_cache_usage": s.kv_usage,
            "num_free_blocks": s.num_free_blocks,
            "num_blocks": s.num_blocks,
            "num_preemptions_total": s.num_preemptions_total,
            "history": list(self.history),
            "recent_requests": self.recent_traces(20),
        }
