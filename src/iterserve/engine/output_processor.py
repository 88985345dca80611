"""The output side of the engine: sampled tokens -> text, stop strings, logprobs, RequestOutputs.

It owns the live requests' text state (engine/request_state.py) and never calls the
scheduler: when a sequence must end for a reason only the text shows (a stop string) or
because handling its token failed, it returns `(scheduler request id, reason)` pairs and the
engine ends them there. So the engine decides *when* the scheduler hears of it and this
module stays testable without one.

Cost: a step costs O(sequences that changed in it), not O(n) per request. A RequestOutput
lists the sequences that advanced or finished in this step; the final one (finished=True)
lists all n, by index, and carries the whole request's metrics. With n = 1 the two are the
same thing; before this, every step rebuilt all n sequences' outputs and metrics, so a
request with n = 1000 and max_tokens 1 cost O(n^2 / max_num_seqs).

Structured outputs: a constrained sequence has its own GrammarMatcher (SequenceState.matcher),
advanced by every token it samples; `grammar_bitmask(sched_out)` fills the masks of the
constrained sequences that sample in a step (the engine hands them to the executor on the
SchedulerOutput), and a sequence whose grammar is complete ends with "stop" at once. A
preempted sequence keeps its output tokens (recompute and swap alike), so its matcher,
which has seen exactly those tokens, needs nothing.

Failure isolation: an exception while handling one sequence's token ends that sequence
(finish reason "error", the message in RequestOutput.error) and nothing else.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping

from iterserve.core.request import FinishReason
from iterserve.core.scheduler_output import PoolingOutput, SampleResult
from iterserve.engine.input_processor import ProcessedRequest
from iterserve.engine.metrics import RequestMetrics, StepStats, merge_metrics
from iterserve.engine.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprob
from iterserve.engine.request_state import RequestState, SequenceState
from iterserve.engine.tracing import count_token
from iterserve.errors import ConstraintTooComplexError
from iterserve.model.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

# Scheduler request ids the engine must end, and the reason; a third element, when present,
# is how many output tokens to keep (a stop inside the tokens a verification appended).
ToEnd = list[tuple]

OVERLAP_BITMASK_FILL = True    # measured by benchmarks/bench_constrained_overhead.py and
                               # benchmarks/bench_constrained_stall.py


class OutputProcessor:
    def __init__(self, tokenizer: Any, *, clock: Callable[[], float],
                 detokenizer_factory: Callable[..., Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        if detokenizer_factory is None:
            detokenizer_factory = IncrementalDetokenizer
        self.detokenizer_factory = detokenizer_factory
        self.requests: dict[str, RequestState] = {}                       # live, by request id
        self._seqs: dict[str, tuple[RequestState, SequenceState]] = {}    # by scheduler id
        self._changed: dict[str, RequestState] = {}      # requests with something to emit
        self._matchers: dict[str, Any] = {}              # scheduler id -> GrammarMatcher (live)
        # Compute each sequence's next mask on a worker thread as soon as its matcher has
        # its state, overlapped with the rest of the step and the next forward pass; a
        # sequence whose mask is late sits that step out (structured/masks.py). False: fill
        # the masks before execute().
        self.overlap_bitmask_fill = OVERLAP_BITMASK_FILL
        self._mask_filler: Any = None
        self._pending_mask: Any = None

    # --- requests in and out -------------------------------------------------------------
    def add_request(self, req: ProcessedRequest) -> RequestState:
        """The text state of a validated request (one detokenizer per sequence)."""
        state = RequestState(req.request_id, req.prompt, req.prompt_token_ids, req.params,
                             req.priority, req.arrival_time, req.arrival_wall_time,
                             pooling=req.pooling_params is not None)
        for i, r in enumerate(req.requests):
            sp = r.sampling_params
            kw = {"min_tokens": sp.min_tokens} if sp.min_tokens and sp.stop else {}
            detok = self.detokenizer_factory(self.tokenizer, req.prompt_token_ids,
                                             skip_special_tokens=sp.skip_special_tokens,
                                             stop=tuple(sp.stop), **kw)
            matcher = req.grammar.matcher(sp.stop_token_ids) if req.grammar is not None else None
            state.seqs.append(SequenceState(i, r, detok, [] if sp.logprobs is not None else None,
                                            matcher=matcher))
        self.requests[state.request_id] = state
        for seq in state.seqs:
            self._seqs[seq.request.request_id] = (state, seq)
            if seq.matcher is not None:
                self._matchers[seq.request.request_id] = seq.matcher
                self._prefetch(seq.request.request_id, seq.matcher)
        return state

    def _filler(self) -> Any:
        if self._mask_filler is None:
            from iterserve.structured.masks import MaskFiller   # torch: structured requests only
            self._mask_filler = MaskFiller()
        return self._mask_filler

    def _prefetch(self, rid: str, matcher: Any) -> None:
        if self.overlap_bitmask_fill:
            self._filler().prefetch(rid, matcher)

    def _forget(self, rid: str) -> None:
        self._matchers.pop(rid, None)
        if self._mask_filler is not None:
            self._mask_filler.forget(rid)

    @property
    def has_constrained(self) -> bool:
        return bool(self._matchers)

    def is_constrained(self, request_id: str) -> bool:
        """A live sequence (scheduler id) with a grammar matcher."""
        return request_id in self._matchers

    def grammar_bitmask(self, sched_out: Any) -> Any:
        """The step's GrammarBitmask (structured.bitmask) for the live constrained sequences
        that sample in it (their chunk reaches their last token), or None."""
        matchers = self._matchers
        starts = {d.req_id: d.num_computed_tokens for d in sched_out.scheduled_new_reqs
                  if d.req_id in matchers}
        for d in sched_out.scheduled_cached_reqs:
            if d.req_id in matchers:
                starts[d.req_id] = d.num_computed_tokens
        sampling = {}
        for rid, start in starts.items():
            state, seq = self._seqs[rid]
            if not seq.finished and \
                    start + sched_out.num_scheduled_tokens.get(rid, 0) >= seq.request.num_tokens:
                sampling[rid] = matchers[rid]
        if not sampling:
            return None
        spec = sched_out.scheduled_spec_decode_tokens
        drafts = {rid: spec[rid] for rid in sampling if rid in spec} if spec else None
        if not self.overlap_bitmask_fill:
            from iterserve.structured.bitmask import GrammarBitmask   # torch: structured only
            return GrammarBitmask.fill(sampling, drafts=drafts)
        if drafts:
            # A step verifying drafts: its masks depend on the drafts, so the whole step is
            # filled at once on the mask worker (after any mask computing ahead there) and
            # waited for; a sequence with drafts cannot sit out one token of several.
            self._pending_mask = self._filler().step_with_drafts(sampling, drafts)
            return self._pending_mask
        # Masks computed ahead (structured/masks.py); a matcher that fails there is named in
        # the result and its sequence ended when its token comes back (process_tokens); one
        # whose mask is late is `deferred` and sits the step out (the engine's sit_out).
        self._pending_mask = self._filler().step(
            sampling, num_scheduled=len(sched_out.num_scheduled_tokens))
        return self._pending_mask

    def draft_limits(self) -> dict[str, int]:
        """Speculative decoding: for each live constrained sequence with drafts for its next
        step, how many of them its grammar takes, where that is fewer than all ({seq id:
        count}). Called once the step's tokens have advanced the matchers; each matcher
        takes the drafts and gives them back."""
        limits: dict[str, int] = {}
        for rid, m in self._matchers.items():
            req = self._seqs[rid][1].request
            drafts = req.spec_token_ids
            if not drafts:
                continue
            if self._mask_filler is not None:
                self._mask_filler.settle(rid)    # its mask job reads the matcher
            n = m.accept_tokens(drafts)
            if n:
                m.rollback(n)
            if n < len(drafts):
                limits[rid] = n
        return limits

    def discard(self, request_id: str) -> None:
        """Forget a request that never reached the scheduler (its add failed)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for seq in state.seqs:
                self._seqs.pop(seq.request.request_id, None)
                self._forget(seq.request.request_id)
            self._changed.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def has_unemitted_outputs(self) -> bool:
        return bool(self._changed)

    def abort(self, request_id: str) -> list[str] | None:
        """Mark every unfinished sequence of a request aborted; their scheduler ids (None if
        the request is not live). The final output comes with the next make_outputs()."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        ids = []
        for seq in state.seqs:
            if not seq.finished:
                ids.append(seq.request.request_id)
                state.end(seq, FinishReason.ABORT)
                self._mark(state, seq)
        self._changed[request_id] = state
        return ids

    # --- a step's results ----------------------------------------------------------------
    def live_tokens(self, results: Mapping[str, SampleResult]) -> dict[str, int | list[int]]:
        """The sampled token of each sequence still live here (others' are dropped); for a
        sequence that verified drafts, its tokens (SampleResult.token_ids). Pooling
        requests' vectors are not tokens: `process_pooled` takes them."""
        seqs = self._seqs
        return {rid: (r.token_ids if r.verified else r.token_id) for rid, r in results.items()
                if rid in seqs and not seqs[rid][1].finished
                and not isinstance(r, PoolingOutput)}

    def process_pooled(self, results: Mapping[str, Any], stats: StepStats) -> None:
        """Keep each live pooling request's vector for its final output (the scheduler
        finishes the request in the same step; its prompt counts in the step's stats)."""
        for rid, r in results.items():
            if not isinstance(r, PoolingOutput):
                continue
            entry = self._seqs.get(rid)
            if entry is None or entry[1].finished:
                continue
            state = entry[0]
            state.embedding = r.data
            if not state.counted_prompt:
                state.counted_prompt = True
                stats.num_prompt_tokens += len(state.prompt_token_ids)
            req = entry[1].request
            if req.num_cached_tokens > state.num_cached_tokens:
                state.num_cached_tokens = req.num_cached_tokens

    def end_by_scheduler(self, request_ids: Iterable[str], default: FinishReason) -> None:
        """Sequences the scheduler ended, by scheduler id: outside a forward pass (abort,
        timeout: default ABORT) or on length / eos / stop token in update_from_output
        (default STOP). Their `Request` is the one this processor holds, so the reason is
        read from it; sequences already ended here (stop strings, aborts) are skipped."""
        for rid in request_ids:
            entry = self._seqs.get(rid)
            if entry is None or entry[1].finished:
                continue
            state, seq = entry
            req = seq.request
            reason = req.finish_reason or default
            state.end(seq, reason)
            if reason is FinishReason.STOP and req.output_token_ids and \
                    req.output_token_ids[-1] in req.sampling_params.stop_token_ids:
                seq.stop_reason = req.output_token_ids[-1]
            self._flush_text(state, seq)
            self._mark(state, seq)

    def fail(self, rids: Iterable[str], message: str, code: str | None = None) -> ToEnd:
        """End sequences with finish reason "error" (executor failure, broken state; `code`
        when it is the request's own fault, e.g. "constraint_too_complex")."""
        to_end: ToEnd = []
        for rid in rids:
            entry = self._seqs.get(rid)
            if entry is None:
                continue
            state, seq = entry
            state.end(seq, FinishReason.ERROR)
            if state.error is None:
                state.error, state.error_code = message, code
            self._mark(state, seq)
            to_end.append((rid, FinishReason.ERROR))
        return to_end

    def process_tokens(self, sampled: Mapping[str, int | list[int]],
                       results: Mapping[str, SampleResult], stats: StepStats) -> ToEnd:
        """Detokenise this step's tokens; the sequences a stop string (or a failure) ends.

        A sequence that verified drafts has several tokens; only those the scheduler kept
        (it stops at an EOS, a stop token or the length) are handled, in order, and a stop
        string in one of them ends the sequence there: the tokens after it are cut off
        (by the scheduler, as it ends the sequence, or here if it has already ended)."""
        to_end: ToEnd = []
        pending, self._pending_mask = self._pending_mask, None
        # Waits for the step's fill if the executor did not (the matchers change below).
        failed = pending.failed_rows() if pending is not None else {}
        for rid, token_id in sampled.items():
            state, seq = self._seqs[rid]
            if rid in failed:                    # its mask could not be computed this step
                to_end += self._fail_grammar(rid, seq, failed[rid])
                continue
            res = results[rid]
            try:
                ending = len(to_end)
                if isinstance(token_id, int):
                    if self._process_token(state, seq, token_id, res, stats):
                        to_end.append((rid, FinishReason.STOP))
                else:
                    self._process_verified(state, seq, token_id, res, stats, to_end)
                if seq.matcher is not None and not seq.finished and len(to_end) == ending:
                    self._prefetch(rid, seq.matcher)     # its next mask, from now on
            except ConstraintTooComplexError as e:
                to_end += self.fail([rid], str(e), e.code)
            except Exception as e:
                logger.exception("request %s failed while handling its token", rid)
                to_end += self.fail([rid], f"{type(e).__name__}: {e}")
            self._mark(state, seq)
        return to_end

    def _process_verified(self, state: RequestState, seq: SequenceState, tokens: list[int],
                          res: SampleResult, stats: StepStats, to_end: ToEnd) -> None:
        req = seq.request
        kept = min(len(tokens), len(req.output_token_ids) - seq.num_tokens)
        per_token = [res, *(res.verified or ())]
        for i in range(kept):
            if self._process_token(state, seq, tokens[i], per_token[i], stats):
                if req.is_finished:              # the scheduler ended it in this step too
                    req.truncate_output(seq.num_tokens)
                    to_end.append((req.request_id, FinishReason.STOP))
                else:
                    to_end.append((req.request_id, FinishReason.STOP, seq.num_tokens))
                return

    def _process_token(self, state: RequestState, seq: SequenceState, token_id: int,
                       result: SampleResult, stats: StepStats) -> bool:
        """One sequence's new token, through each per-sequence output stage in turn (the
        place a structured-output matcher or tool-call parser would be fed). True when a
        stop string ended the sequence."""
        req = seq.request
        seq.delta_token_ids.append(token_id)
        seq.num_tokens += 1
        count_token(stats, state, req, seq.num_tokens - 1)
        if req.num_cached_tokens > state.num_cached_tokens:
            state.num_cached_tokens = req.num_cached_tokens
        if result.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = self._prompt_logprobs(result.prompt_logprobs)
        if seq.logprobs is not None:
            lp = TokenLogprob(token_id, result.logprob, result.top_logprobs)
            seq.logprobs.append(lp)
            seq.delta_logprobs.append(lp)
        if seq.matcher is not None and not seq.matcher.accept(token_id):
            limit = seq.matcher.engine_error()
            if limit is not None:
                # The mask allowed the token, but taking it overran the grammar engine's
                # own limits (an Earley row, the lexer's expressions): the constraint is too
                # complex at this length, the request's fault, not the server's.
                raise ConstraintTooComplexError(self._overrun_message(state, seq, limit))
            # The step's mask allowed only tokens the grammar takes: a token it refuses
            # means the mask was not applied (a broken executor), so the output is invalid.
            raise RuntimeError(f"sampled token {token_id} violates the request's "
                               f"{seq.matcher.grammar.kind} constraint")
        delta = seq.detokenizer.add(token_id)
        if delta.text:
            seq.text += delta.text
            seq.delta_text += delta.text
        if delta.stopped:
            seq.stop_reason = getattr(delta, "stop_string", None)
            if req.sampling_params.include_stop_str_in_output and seq.stop_reason:
                seq.text += seq.stop_reason
                seq.delta_text += seq.stop_reason
            state.end(seq, FinishReason.STOP)      # a stop string wins over "length"
            return True
        if seq.matcher is not None and seq.matcher.is_terminated():
            if token_id in req.sampling_params.stop_token_ids:
                seq.stop_reason = token_id
            state.end(seq, FinishReason.STOP)      # the grammar is complete: nothing may follow
            self._flush_text(state, seq)
            return True
        return False

    def _fail_grammar(self, rid: str, seq: SequenceState, error: str) -> ToEnd:
        limit = seq.matcher.engine_error() if seq.matcher is not None else None
        if limit is not None:
            state = self._seqs[rid][0]
            return self.fail([rid], self._overrun_message(state, seq, limit),
                             ConstraintTooComplexError.code)
        return self.fail([rid], f"grammar error: {error}")

    @staticmethod
    def _overrun_message(state: RequestState, seq: SequenceState, error: str) -> str:
        so = getattr(state.params, "structured_outputs", None)
        where = (getattr(so, "source", None) or f"structured_outputs.{seq.matcher.grammar.kind}")
        return (f"{where}: after {seq.matcher.num_tokens} tokens the constraint exceeded the "
                f"grammar engine's limits ({error}); simplify it (a right-recursive rule "
                "grows with the output: make it left-recursive)")

    def _prompt_logprobs(self, entries) -> list:
        """The runner's (token, logprob, rank, top-k) entries in vLLM's shape: None for the
        first prompt token, then {token id: Logprob} (the actual token and the top k)."""
        texts: dict[int, str] = {}

        def text(tid: int) -> str:
            t = texts.get(tid)
            if t is None:
                t = texts[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
            return t

        out: list = [None]
        for tid, lp, rank, top in entries:
            d = {t: Logprob(v, r, text(t)) for r, (t, v) in enumerate(top, 1)}
            if tid not in d:
                d[tid] = Logprob(lp, rank, text(tid))
            out.append(d)
        return out

    def _flush_text(self, state: RequestState, seq: SequenceState) -> None:
        if seq.finish_reason is FinishReason.STOP and isinstance(seq.stop_reason, str):
            return                          # text after a stop string is never shown
        rest = seq.detokenizer.flush()
        if rest:
            seq.text += rest
            seq.delta_text += rest
        if getattr(seq.detokenizer, "stopped", False) and seq.finish_reason is FinishReason.LENGTH:
            state.end(seq, FinishReason.STOP)   # the held-back tail completed a stop string

    def _mark(self, state: RequestState, seq: SequenceState) -> None:
        if seq.finished and seq.matcher is not None:
            self._forget(seq.request.request_id)
        state.mark(seq)
        self._changed[state.request_id] = state

    # --- outputs -------------------------------------------------------------------------
    def make_outputs(self, stats: StepStats) -> tuple[list[RequestOutput], list[RequestState]]:
        """One RequestOutput per request with something new; also the requests that
        finished (retired here: the caller records their traces)."""
        changed, self._changed = self._changed, {}
        outputs, retired = [], []
        for state in changed.values():
            if state.params.num_sequences > state.params.n and not state.finished:
                continue        # best_of: only the final output, once the n best are known
            outputs.append(self._make_output(state, stats))
            if state.finished:
                self._retire(state)
                retired.append(state)
        return outputs, retired

    def _make_output(self, state: RequestState, stats: StepStats) -> RequestOutput:
        now = self.clock()
        just_finished: set[int] = set()
        for seq in state.changed:
            if seq.finished and not seq.reported:
                seq.metrics = RequestMetrics.from_request(seq.request, now)
                just_finished.add(seq.index)
                stats.finished.append(seq.metrics)
                stats.finish_reasons.append(seq.finish_reason.value)
        finished = state.finished
        if finished:
            seqs = state.seqs
        elif len(state.changed) > 1:
            seqs = sorted(state.changed, key=lambda s: s.index)
        else:
            seqs = state.changed
        outs = [] if state.pooling else \
            [self._completion(seq, seq.index in just_finished) for seq in seqs]
        if finished and state.params.num_sequences > state.params.n:
            outs = self._best_of(outs, state.params)
        for seq in state.changed:
            seq.delta_text, seq.delta_token_ids, seq.delta_logprobs = "", [], []
            seq.changed = False
        state.changed = []
        metrics = merge_metrics([s.metrics for s in state.seqs]) if finished else None
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs,
                             finished=finished, metrics=metrics, error=state.error,
                             error_code=state.error_code,
                             num_cached_tokens=state.num_cached_tokens,
                             prompt_logprobs=state.prompt_logprobs,
                             embedding=state.embedding if finished else None)

    @staticmethod
    def _completion(seq: SequenceState, just_finished: bool) -> CompletionOutput:
        """Cumulative state plus this step's delta (empty for a sequence that did not
        change; its last delta went out with the output it changed in)."""
        return CompletionOutput(
            index=seq.index, text=seq.text, token_ids=list(seq.request.output_token_ids),
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            delta_text=seq.delta_text, delta_token_ids=seq.delta_token_ids,
            delta_logprobs=seq.delta_logprobs if seq.logprobs is not None else None,
            finished_in_this_step=just_finished,
            metrics=seq.metrics if seq.finished else None)

    @staticmethod
    def _best_of(outs: list[CompletionOutput], params) -> list[CompletionOutput]:
        """vLLM V0's best_of: the n sequences with the highest cumulative logprob, best
        first, indexed 0..n-1; the ranking logprobs are dropped unless the request asked."""
        def score(co: CompletionOutput) -> float:
            return sum(lp.logprob for lp in co.logprobs or () if lp.logprob is not None)

        best = sorted(outs, key=score, reverse=True)[:params.n]
        for i, co in enumerate(best):
            co.index = i
            if params.logprobs is None:
                co.logprobs = co.delta_logprobs = None
        return best

    def _retire(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for seq in state.seqs:
            self._seqs.pop(seq.request.request_id, None)
            self._forget(seq.request.request_id)
