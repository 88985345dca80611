"""The iteration-level scheduler: one `schedule()` per step decides what every request runs.

A request is a token list of which `num_computed_tokens` are in the KV cache (see
request.py). Each step the scheduler gives each request a number of tokens to compute: the
whole (or a chunk of the) uncomputed part for a prompt, a recomputed request or a prefix-cache
hit, or 1 for a decode. One loop covers all of them, as in vLLM's v1 core and nano-vllm:

1. Timeouts: requests whose deadline (any state) or queue deadline (never admitted) passed
   end with FinishReason.TIMEOUT.
2. Running requests, in admission order (under `priority`: by priority, then admission),
   each get their next chunk within the token budget.
   When one needs a KV block and none is free, the least urgent running request is
   preempted (recompute: blocks freed, requeued at the front of its class; swap: blocks moved
   to host memory); if it was already scheduled this step, its tokens go back to the budget.
3. If nothing was preempted, swapped requests are swapped back in while blocks allow.
4. If nothing was preempted, waiting requests are admitted in queue order while the budget,
   `max_num_seqs`, the partial-prefill cap and the KV pool allow (prefix-cache hits are
   claimed first). Under the `priority` policy a waiting request may preempt a strictly less
   urgent running one, both when `max_num_seqs` is full and when the KV pool is, and
   running requests less urgent than the waiting head sit the step out (`_yield_to`); with
   `priority_less_urgent_tokens`, while a more urgent class is active (running, waiting, or
   seen in the last `priority_guard_steps` steps) the less urgent requests share that many
   tokens per step, round robin, so the step in flight when an urgent request arrives is
   short (`_low_cap_now`). With `max_long_partial_prefills` (vLLM's) below
   `max_num_partial_prefills`, a long prompt (more than `long_prefill_token_threshold`
   tokens left) over the long cap is passed over, keeping its place, and shorter prompts
   behind it start; likewise, with a threshold set, a prompt that would be one partial
   prefill over `max_num_partial_prefills` is passed over for the prompts behind it that
   complete within the budget left. With `max_long_prefill_tokens` the chunks of long
   prompts (more than the threshold in all) take at most that many tokens per step
   together: the step that ends one long prefill starts the next with what is left of it,
   and a long prompt that finds it spent is passed over like one over the long cap. Under the
   `slo` policy (core/slo_policy.py) the queue is ordered by slack, a request that cannot
   meet its TTFT target is refused in add_request, and admission holds while one more
   decode would push the running requests past their TPOT target.

`static` batching (for comparison with continuous batching on the same engine) forms a group
of up to `max_num_seqs` waiting requests when nothing runs, is preempted or swapped, and
admits nothing else until every member has finished.

What the executors get is data (scheduler_output.py): a request the executor does not hold
comes once whole, then only as per-step diffs (new block ids, where its tokens start). The
block manager answers allocations with the blocks it added (`KVCacheBlocks`); the scheduler
never reads its tables. `schedule()` ends with cheap asserts (token budget, max_num_seqs).

Per-step cost is O(running requests) with small constants: a decode that needs no new block
copies nothing, nothing is recorded per decode step, queues are a deque or a heap with lazy
removal, and timeouts sit in a heap keyed by time.
"""

from __future__ import annotations

import collections
import heapq
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from iterserve.core.block_manager import BlockManager, cdiv
from iterserve.core.config import (
    Batching, CacheConfig, PreemptionMode, SchedulerConfig, SchedulingPolicy)
from iterserve.core.request import FinishReason, Request, RequestStatus, SamplingParamsError
from iterserve.core.request_queue import FCFSQueue, PriorityQueue, make_queue
from iterserve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

_RUNNING = RequestStatus.RUNNING


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_queued_requests` requests; retry later (HTTP 503/429)."""


@dataclass(slots=True)
class SchedulerStats:
    step: int
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float                 # fraction of the device pool in use (0..1)
    num_free_blocks: int            # evictable prefix-cache blocks count as free
    num_blocks: int
    num_batched_tokens: int         # tokens scheduled in the last step
    num_preemptions: int            # preemptions (recompute or swap) in the last step
    num_preemptions_total: int
    prefix_cache_hit_rate: float = 0.0   # cached / looked-up prompt blocks, lifetime


class Scheduler:
    """Decides, step by step, which tokens of which requests the executor computes."""

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config.validate()
        self.cache_config = cache_config.validate()
        self.clock = clock
        self.block_manager = BlockManager(
            cache_config.num_kv_blocks, cache_config.block_size, cache_config.num_swap_blocks,
            cache_config.enable_prefix_caching)
        self.step = 0
        self.requests: dict[str, Request] = {}          # every unfinished request
        self.running: list[Request] = []                # admission order
        self._priority = config.scheduling_policy is SchedulingPolicy.PRIORITY
        # The `slo` policy (core/slo_policy.py) owns its waiting queue; its hooks are the
        # `if self.slo is not None` lines below (add_request, schedule, update_from_output).
        self.slo = None
        if config.scheduling_policy is SchedulingPolicy.SLO:
            from iterserve.core.slo_policy import SloPolicy

            self.slo = SloPolicy(self)
            self.waiting = self.slo.queue
        else:
            self.waiting = make_queue(config.scheduling_policy.value)
        self.swapped = PriorityQueue(use_priority=self._priority)
        self._static = config.batching is Batching.STATIC
        self._swap = config.preemption_mode is PreemptionMode.SWAP
        self._chunked = config.enable_chunked_prefill
        self._threshold = config.long_prefill_token_threshold
        # vLLM's max_long_partial_prefills: only with several partial prefills and a
        # threshold that says what "long" is (validate() requires it when
        # the cap binds).
        # None (the default) is max_num_partial_prefills: no cap of its own.
        long_cap = config.max_long_partial_prefills
        self._max_long = (long_cap if long_cap and long_cap < config.max_num_partial_prefills
                          and self._threshold else 0)
        # max_long_prefill_tokens: what the chunks of long prompts (more than the threshold
        # in all) may take per step together, so the step that ends one long prefill and
        # starts the next costs what the others cost (with chunked prefill only: unchunked,
        # a long prompt runs whole or never).
        self._long_tokens = (config.max_long_prefill_tokens
                             if self._chunked and self._threshold else 0)
        # Priority: the most urgent class seen lately and the step it was last seen
        # (priority_less_urgent_tokens caps the others while it is active).
        self._low_cap = config.priority_less_urgent_tokens if self._priority else 0
        self._urgent: tuple[int, int] | None = None
        # Requests whose state the executors hold (sent as NewRequestData and not finished
        # or preempted by recompute since): a swapped-in one of these comes back as a diff.
        self._sent: set[str] = set()
        # Token slots each running request was granted, from the block manager's answers
        # (blocks held x block_size): a step that fits asks the block manager nothing.
        self._granted: dict[str, int] = {}
        # Static batching: members of the current group not yet admitted (or requeued after
        # preemption), and the ids of all unfinished members.
        self._group = FCFSQueue()
        self._group_ids: set[str] = set()
        # (time, seq, is_queue_deadline, request): checked at the start of schedule().
        self._timeouts: list[tuple[float, int, bool, Request]] = []
        self._timeout_seq = 0
        self._ended: list[str] = []          # ended by finish_request, for the next output
        self._finished: list[str] = []       # every request finished since the last output
        self._last_batched = 0
        self._last_preemptions = 0
        self._preemptions_total = 0

    # --- requests in ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request, or raise ValueError / QueueFullError saying why not (under
        the `slo` policy, SLOUnattainableError, a QueueFullError with a retry-after)."""
        cfg = self.config
        rid = request.request_id
        now = self.clock()
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already in the scheduler")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} has already been scheduled "
                             f"(status {request.status.value})")
        request.sampling_params.validate()
        if self.slo is None and (request.ttft_slo_ms is not None
                                 or request.tpot_slo_ms is not None):
            # A latency target only the slo policy honours: refused, never silently ignored.
            f = "ttft_slo_ms" if request.ttft_slo_ms is not None else "tpot_slo_ms"
            raise SamplingParamsError(
                f"{f} needs a server started with --scheduling-policy slo (this one "
                f"schedules {getattr(cfg.scheduling_policy, 'value', cfg.scheduling_policy)})", f)
        n = request.num_prompt_tokens
        if n >= cfg.max_model_len:
            self._reject(request, now, "prompt_too_long")
            raise ValueError(
                f"request {rid!r}: the prompt has {n} tokens but max_model_len is "
                f"{cfg.max_model_len}; it must be shorter to leave room for an output token")
        # The last sampled token is never computed, so a request holds at most len - 1 tokens.
        final_len = min(n + request.sampling_params.max_tokens, cfg.max_model_len)
        bm = self.block_manager
        blocks = bm.num_blocks_for(final_len - 1)
        if blocks > bm.num_blocks:
            self._reject(request, now, "kv_too_small")
            raise ValueError(
                f"request {rid!r}: {final_len} tokens (prompt {n} + max_tokens "
                f"{request.sampling_params.max_tokens}, capped at max_model_len) need {blocks} "
                f"KV blocks of {bm.block_size} tokens but the pool has only {bm.num_blocks}")
        if cfg.max_queued_requests and self.num_waiting >= cfg.max_queued_requests:
            self._reject(request, now, "queue_full")
            raise QueueFullError(
                f"the waiting queue is full ({self.num_waiting} requests, "
                f"max_queued_requests={cfg.max_queued_requests}); retry later")

        if self.slo is not None:
            if request.ttft_slo_ms is None:
                request.ttft_slo_ms = cfg.slo_ttft_ms
            if request.tpot_slo_ms is None:
                request.tpot_slo_ms = cfg.slo_tpot_ms
            try:
                self.slo.on_add(request)          # SLOUnattainableError: refused early
            except QueueFullError:
                self._reject(request, now, "slo_unattainable")
                raise

        if request.deadline is None and cfg.request_timeout is not None:
            request.deadline = request.arrival_time + cfg.request_timeout
        if request.queue_deadline is None and cfg.queue_timeout is not None:
            request.queue_deadline = request.arrival_time + cfg.queue_timeout
        for when, is_queue in ((request.deadline, False), (request.queue_deadline, True)):
            if when is not None:
                self._timeout_seq += 1
                heapq.heappush(self._timeouts, (when, self._timeout_seq, is_queue, request))

        self.requests[rid] = request
        self.waiting.push(request)
        request.record("arrived", request.arrival_time, self.step)
        request.record("queued", now, self.step)

    def _reject(self, request: Request, now: float, reason: str) -> None:
        request.record("rejected", now, self.step, reason=reason)

    # --- requests out ---------------------------------------------------------------------
    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request in any state (abort, stop string, error) and free all it holds.

        Idempotent: None for unknown or already finished ids. The request is listed in the
        next SchedulerOutput.finished so executors can drop per-request state.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        status = request.status
        if status is _RUNNING:
            self.running.remove(request)
        elif status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif not self.waiting.remove(request):
            self._group.remove(request)
        self.block_manager.free(request)
        self._finish(request, reason, self.clock())
        self._ended.append(request_id)
        return request

    def _finish(self, request: Request, reason: FinishReason, now: float) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = now
        request.record("finished", now, self.step, reason=reason.value)
        self._finished.append(request.request_id)
        self._sent.discard(request.request_id)
        self._granted.pop(request.request_id, None)
        if self._static:
            self._group_ids.discard(request.request_id)

    def _expire_timeouts(self, now: float) -> None:
        heap = self._timeouts
        while heap and heap[0][0] <= now:
            _, _, is_queue, request = heapq.heappop(heap)
            if request.is_finished or request.request_id not in self.requests:
                continue
            if is_queue and request.first_scheduled_time is not None:
                continue                           # admitted before its queue deadline
            self.finish_request(request.request_id, FinishReason.TIMEOUT)

    # --- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens. Call once per step, then update_from_output()."""
        cfg = self.config
        bm = self.block_manager
        now = self.clock()
        step = self.step
        out = SchedulerOutput(step=step)
        slo = self.slo
        if slo is not None:
            slo.step_started()
        if self._timeouts and self._timeouts[0][0] <= now:
            self._expire_timeouts(now)
        if self._finished:
            out.finished_req_ids = self._finished
            self._finished = []
        if self._ended:
            out.ended_req_ids = self._ended
            self._ended = []

        budget = cfg.max_num_batched_tokens
        clamp = self._clamp
        num_sched = out.num_scheduled_tokens          # filled in scheduling order
        cached = out.scheduled_cached_reqs            # (a list: appended once per request)
        new: dict[str, NewRequestData] = {}
        running = self.running
        allocate = bm.allocate_slots
        granted = self._granted
        block_size = bm.block_size
        num_preempted = 0
        num_partial = 0       # requests that will still be mid-prefill after this step
        num_long = 0          # of those, long ones (max_long_partial_prefills)
        threshold = self._threshold
        long_cap = self._long_tokens
        long_left = long_cap      # max_long_prefill_tokens left this step (if long_cap)
        # Priority with priority_less_urgent_tokens: requests less urgent than `low_p` share
        # `low_left` tokens this step (None: no cap); `low_sched` are those scheduled.
        low_p, low_left = self._low_cap_now(step) if self._low_cap else (None, 0)
        low_sched: list[Request] = []
        low_skipped = False

        # Priority: a waiting request more urgent than running ones is admitted this step
        # ahead of them (see _yield_to): those of a strictly lower priority sit it out.
        yield_below = self._yield_to() if self._priority else None

        # 1. Running requests first.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            start = req.num_computed_tokens
            num_tokens = len(req.all_token_ids)      # (properties cost ~2x on this path)
            n = num_tokens - start
            if yield_below is not None and req.priority > yield_below:
                i += 1                      # yields this step to a more urgent arrival
                continue
            low = low_p is not None and req.priority > low_p
            if low and low_left <= 0:
                low_skipped = True
                i += 1                      # the less urgent share of this step is spent
                continue
            if n > 1:
                if threshold and n > threshold:
                    num_long += 1           # a long prefill (or recompute) mid-way
                cap = low_left if low and low_left < budget else budget
                long_req = long_cap and num_tokens > threshold
                if long_req and long_left < cap:
                    cap = long_left
                n = clamp(n, cap)
                if not n:
                    i += 1                  # a whole recompute that does not fit this step
                    continue
                if long_req:
                    long_left -= n
            rid = req.request_id
            if start + n <= granted[rid]:
                new_blocks = ()             # the common decode step: its last block has room
            else:
                while (blocks := allocate(req, n)) is None:
                    victim = self._pick_victim(running)
                    idx = running.index(victim)
                    if idx < i:
                        i -= 1
                    budget += self._preempt(victim, idx, out, new, cached)
                    num_preempted += 1
                    if victim is req:
                        break
                if blocks is None:
                    continue                # running[i] is now the next request
                new_blocks = blocks.block_ids
                granted[rid] += len(new_blocks) * block_size
            num_sched[rid] = n
            cached.append(CachedRequestData(rid, new_blocks, start))
            budget -= n
            if low:
                low_left -= n
                low_sched.append(req)
            if start + n < num_tokens:          # still mid-prefill after this step
                num_partial += 1
                req.record("prefill_chunk", now, step, start=start, num_tokens=n)
            elif n > 1 or start < len(req.prompt_token_ids):
                req.record("prefill_chunk", now, step, start=start, num_tokens=n)
            i += 1

        max_seqs = cfg.max_num_seqs
        swapped_in_now: set[str] = set()
        # 2. Swapped requests come back before new work is admitted.
        if not num_preempted and self.swapped:
            while budget > 0 and len(running) < max_seqs:
                req = self.swapped.peek()
                if req is None:
                    break
                start = req.num_computed_tokens
                low = low_p is not None and req.priority > low_p
                n = clamp(req.num_tokens - start, min(budget, low_left) if low else budget)
                if not n or not bm.can_swap_in(req, n):
                    break
                self.swapped.pop()
                out.blocks_to_swap_in.extend(bm.swap_in(req))
                ok = allocate(req, n)
                assert ok is not None, "swap-in fit check and allocation disagree"
                req.status = _RUNNING
                self._add_running(req)
                rid = req.request_id
                out.swapped_in_req_ids.append(rid)
                swapped_in_now.add(rid)
                req.record("swapped_in", now, step)
                req.record("resumed", now, step)
                num_sched[rid] = n
                table = bm.get_blocks(rid).block_ids
                granted[rid] = len(table) * block_size
                if rid in self._sent:
                    cached.append(CachedRequestData(rid, table, start, True))
                else:                       # swapped out the step it was admitted
                    new[rid] = self._new_data(req, table)
                budget -= n
                if low:
                    low_left -= n
                    low_sched.append(req)
                if start + n < req.num_tokens:
                    num_partial += 1

        # 3. Admit waiting requests.
        if not num_preempted:
            if self._static:
                source = self._group
                if not self._group_ids and not running and not self.swapped:
                    self._form_group()
            else:
                source = self.waiting
            preempt_for_urgent = self._priority and not self._static
            bs = bm.block_size
            # Once a prompt is passed over (max_long_partial_prefills, or the partial cap
            # with a threshold), the queue is read in order from a snapshot and admitted
            # requests are taken out of it.
            scan = None
            retry = None            # (scan mode) the request to try again after a preemption
            while budget > 0:
                if retry is not None:
                    req, retry = retry, None
                else:
                    req = source.peek() if scan is None else next(scan, None)
                if req is None or req.status is RequestStatus.PREEMPTED and \
                        req.request_id in out.preempted_req_ids:
                    break                   # never re-admit a victim of this very step
                if self.swapped:
                    head = self.swapped.peek()
                    if not (self._priority and req.priority < head.priority):
                        break               # swapped requests resume before new work
                if slo is not None and running and slo.hold(req, running):
                    break                   # one more decode would break a TPOT target
                if len(running) >= max_seqs:
                    if preempt_for_urgent and self._preempt_less_urgent(
                            req, running, out, new, cached, swapped_in_now):
                        budget, num_partial = self._recount(num_sched)
                        num_preempted += 1
                        retry = req if scan is not None else None
                        continue
                    break
                low = low_p is not None and req.priority > low_p
                if low and low_left <= 0:
                    break                   # (queue order: the rest are no more urgent)
                hits = bm.find_cached_blocks(req)
                num_hit = len(hits) * bs
                left = req.num_tokens - num_hit
                cap = low_left if low and low_left < budget else budget
                long_req = long_cap and left > 1 and req.num_tokens > threshold
                if long_req and long_left < cap:
                    if long_left <= 0:
                        # max_long_prefill_tokens spent by the long chunks already in this
                        # step: pass this long prompt over (it keeps its place).
                        if scan is None:
                            scan = iter([r for r in source if r is not req])
                        continue
                    cap = long_left
                n = clamp(left, cap)
                if not n:
                    break
                partial = num_hit + n < req.num_tokens
                if partial and num_partial >= cfg.max_num_partial_prefills:
                    if not threshold:
                        break
                    # With a long-prefill threshold the chunks in flight leave budget on
                    # purpose: a prompt that would be one partial prefill too many keeps its
                    # place, and the prompts behind it that complete within what is left
                    # start now (else that budget idles while they wait behind it).
                    if scan is None:
                        scan = iter([r for r in source if r is not req])
                    continue
                is_long = self._max_long and left > threshold
                if is_long and num_long >= self._max_long:
                    # vLLM's max_long_partial_prefills: pass this long prompt over (it keeps
                    # its place) so that shorter prompts behind it can start.
                    if scan is None:
                        scan = iter([r for r in source if r is not req])
                    continue
                blocks = allocate(req, n, hits)
                if blocks is None:
                    if preempt_for_urgent and self._preempt_less_urgent(
                            req, running, out, new, cached, swapped_in_now):
                        budget, num_partial = self._recount(num_sched)
                        num_preempted += 1
                        retry = req if scan is not None else None
                        continue
                    break
                if scan is None:
                    source.pop()
                else:
                    source.take(req)
                req.num_computed_tokens = num_hit
                req.status = _RUNNING
                self._add_running(req)
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                    req.num_cached_tokens = num_hit
                    bm.note_cache_query(req)
                    req.record("scheduled", now, step, num_cached_tokens=num_hit)
                else:
                    req.record("resumed", now, step, num_cached_tokens=num_hit)
                rid = req.request_id
                num_sched[rid] = n
                # The table was empty: the blocks added are all of it (hits included).
                new[rid] = self._new_data(req, blocks.block_ids)
                granted[rid] = len(blocks.block_ids) * block_size
                req.record("prefill_chunk", now, step, start=num_hit, num_tokens=n)
                budget -= n
                if low:
                    low_left -= n
                if long_req:
                    long_left -= n
                if partial:
                    num_partial += 1
                    if is_long:
                        num_long += 1

        if low_skipped and low_sched:
            # Round robin among the less urgent: those that ran go to the back of their
            # priority class, so the ones that sat out run first next step.
            done = {r.request_id for r in low_sched}
            running[:] = [r for r in running if r.request_id not in done]
            for r in low_sched:
                if r.status is _RUNNING:
                    self._add_running(r)

        bm.end_step()
        if new:
            out.scheduled_new_reqs = list(new.values())
            self._sent.update(new)
        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        # Cheap end-of-step checks (vLLM v1 does the same): a broken invariant here would
        # otherwise surface far away, as a wrong token or a leaked block.
        assert budget >= 0, f"step {step} overran the token budget by {-budget}"
        assert len(num_sched) <= max_seqs and len(running) <= max_seqs, (
            f"step {step} runs {len(running)} requests, max_num_seqs is {max_seqs}")
        self._last_batched = out.num_batched_tokens
        self._last_preemptions = num_preempted
        self._preemptions_total += num_preempted
        if slo is not None:
            slo.scheduled(out)
        return out

    def _clamp(self, n: int, budget: int) -> int:
        """Tokens of an n-token remainder to compute this step; 0 when it must wait.

        With chunked prefill: at most long_prefill_token_threshold (if set) and the budget
        left. Without it a remainder runs whole or not at all (the budget covers
        max_model_len, so it fits in some step).
        """
        if self._chunked:
            if n > 1:
                t = self._threshold
                if t and n > t:
                    n = t
                if n > budget:
                    n = budget
            return n
        return n if n <= budget else 0

    @staticmethod
    def _new_data(req: Request, block_ids: tuple[int, ...]) -> NewRequestData:
        return NewRequestData(req.request_id, list(req.prompt_token_ids), req.sampling_params,
                              block_ids, req.num_computed_tokens, list(req.output_token_ids))

    def _recount(self, num_sched: dict[str, int]) -> tuple[int, int]:
        """Budget left and partial prefills after a victim's tokens were withdrawn (rare).

        A scheduled request's num_computed_tokens is still where its tokens start."""
        used = partial = 0
        requests = self.requests
        for rid, n in num_sched.items():
            used += n
            r = requests[rid]
            if r.num_computed_tokens + n < r.num_tokens:
                partial += 1
        return self.config.max_num_batched_tokens - used, partial

    def _form_group(self) -> None:
        """Static batching: take the next group of up to max_num_seqs waiting requests."""
        while len(self._group_ids) < self.config.max_num_seqs and self.waiting:
            req = self.waiting.pop()
            self._group.push(req)
            self._group_ids.add(req.request_id)

    def _add_running(self, req: Request) -> None:
        """Append to the running list; under `priority`, after the last request of equal or
        higher urgency, so step 1 hands out the budget in priority order (an urgent decode
        never waits for budget behind a batch prefill chunk), admission order within a class."""
        running = self.running
        if self._priority and running and running[-1].priority > req.priority:
            p = req.priority
            i = len(running)
            while i > 0 and running[i - 1].priority > p:
                i -= 1
            running.insert(i, req)
        else:
            running.append(req)

    def _low_cap_now(self, step: int) -> tuple[int | None, int]:
        """(priority, tokens): requests less urgent than `priority` share `tokens` this step;
        (None, 0) when no more urgent class is active (priority_less_urgent_tokens).

        The most urgent class present (running, whose list is in priority order, or at the
        head of the waiting queue) is remembered with the step; it stays active for
        priority_guard_steps steps after it was last seen, so a class whose requests come
        one at a time finds short steps when the next one arrives, not a full batch step
        in flight."""
        p_now = None
        if self.running:
            p_now = self.running[0].priority
        head = self.waiting.peek() if self.waiting else None
        if head is not None and (p_now is None or head.priority < p_now):
            p_now = head.priority
        u = self._urgent
        if u is not None and step - u[1] > self.config.priority_guard_steps:
            u = None
        if p_now is not None and (u is None or p_now <= u[0]):
            u = (p_now, step)
        self._urgent = u
        if u is None:
            return None, 0
        return u[0], self._low_cap

    def _yield_to(self) -> int | None:
        """The priority that running requests of a lower one yield to this step, or None.

        vLLM's priority policy preempts a less urgent running request for a more urgent
        waiting one only when slots or KV blocks run out; the token budget and the step's
        time are still spent on the less urgent ones first, so an interactive request
        arriving in a batch flood waits behind batch prefill chunks and then prefills in a
        step full of batch work. Here, when the head of the waiting queue is strictly more
        urgent than some running request (and than the head of the swapped queue, which
        would otherwise resume first), the less urgent running requests are not scheduled
        for this one step: they keep their blocks and resume the next step, the urgent
        prefill gets the whole budget and a step that costs what it would alone. The batch
        class pays one step per urgent admission."""
        if self._static or not self.waiting or not self.running:
            return None
        head = self.waiting.peek()
        if head is None:
            return None
        if self.swapped:
            s = self.swapped.peek()
            if s is not None and s.priority <= head.priority:
                return None
        p = head.priority
        for r in self.running:
            if r.priority > p:
                return p
        return None

    def _victim_key(self, r: Request) -> tuple:
        if self._priority:
            return (r.priority, r.arrival_time, r.request_id)
        return (r.arrival_time, r.request_id)

    def _pick_victim(self, running: list[Request]) -> Request:
        """The least urgent running request: lowest priority (under `priority`), then the
        latest arrival."""
        return max(running, key=self._victim_key)

    def _preempt_less_urgent(self, req: Request, running: list[Request], out: SchedulerOutput,
                             new: dict, cached: list, exclude: set[str]) -> bool:
        """Priority policy: preempt the least urgent running request if it is strictly less
        urgent than `req`. Requests swapped in this very step are not candidates (their
        swap-in copy and a swap-out copy would race in the executor)."""
        candidates = [r for r in running if r.request_id not in exclude] if exclude else running
        if not candidates:
            return False
        victim = max(candidates, key=self._victim_key)
        if victim.priority <= req.priority:
            return False
        self._preempt(victim, running.index(victim), out, new, cached)
        return True

    def _preempt(self, victim: Request, idx: int, out: SchedulerOutput, new: dict,
                 cached: list) -> int:
        """Evict running[idx] (== victim); returns the tokens it had been given this step."""
        del self.running[idx]
        rid = victim.request_id
        self._granted.pop(rid, None)            # its device blocks go either way
        given = out.num_scheduled_tokens.pop(rid, 0)
        if given:                           # scheduled earlier this step: withdraw its data
            if new.pop(rid, None) is None:
                cached[:] = [d for d in cached if d.req_id != rid]
        victim.num_preemptions += 1
        bm = self.block_manager
        now = self.clock()
        if self._swap and bm.can_swap_out(victim):
            mapping = bm.swap_out(victim)
            out.blocks_to_swap_out.extend(mapping)
            out.swapped_out_req_ids.append(rid)
            victim.status = RequestStatus.SWAPPED
            self.swapped.push(victim)
            victim.record("preempted", now, self.step, mode="swap")
            victim.record("swapped_out", now, self.step, num_blocks=len(mapping))
        else:
            # Recompute (also the fallback when swap space is full or absent): the executors
            # drop the request and get it whole again when it is re-admitted.
            bm.free_device(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            (self._group if self._static else self.waiting).push_front(victim)
            out.preempted_req_ids.append(rid)
            self._sent.discard(rid)
            victim.record("preempted", now, self.step, mode="recompute")
        return given

    def update_from_output(self, output: SchedulerOutput,
                           sampled: Mapping[str, int]) -> list[Request]:
        """Apply a step's results: advance computed tokens, append sampled tokens, finish
        requests on length / eos / stop token. Returns the requests finished here."""
        if self.slo is not None:
            self.slo.step_done()              # the executor's measured step time
        now = self.clock()
        bm = self.block_manager
        caching = bm.enable_prefix_caching
        max_len = self.config.max_model_len
        requests = self.requests
        finished: list[Request] = []
        for rid, n in output.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue                    # ended by finish_request after schedule()
            start = req.num_computed_tokens
            computed = start + n
            req.num_computed_tokens = computed
            if caching:
                bm.cache_full_blocks(req)
            all_tokens = req.all_token_ids
            if computed < len(all_tokens):
                continue                    # a prefill chunk that did not reach the end
            token = sampled.get(rid)
            if token is None:
                raise ValueError(
                    f"the executor returned no token for request {rid!r}, whose chunk "
                    f"[{start}, {computed}) reached its last token")
            # Request.append_output_token, inlined: this loop runs for every decode.
            outputs = req.output_token_ids
            outputs.append(token)
            all_tokens.append(token)
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
                req.record("first_token", now, self.step)
            sp = req.sampling_params
            if len(outputs) >= sp.max_tokens or len(all_tokens) >= max_len:
                reason = FinishReason.LENGTH
            elif token == req.eos_token_id and not sp.ignore_eos:
                reason = FinishReason.STOP
            elif sp.stop_token_ids and token in sp.stop_token_ids:
                reason = FinishReason.STOP
            else:
                continue
            del requests[rid]
            bm.free(req)
            self._finish(req, reason, now)
            finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        self.step += 1
        return finished

    def skip_idle_steps(self, n: int) -> None:
        """Advance the step counter by `n` empty steps without calling schedule().

        Only legal while the scheduler holds no request: then an empty schedule() would change
        nothing but the step number. The lab uses it to jump over the gaps between sparse
        arrivals instead of running millions of empty steps.
        """
        if n < 0:
            raise ValueError(f"cannot skip a negative number of steps ({n})")
        if self.requests:
            raise RuntimeError(
                f"cannot skip steps while {len(self.requests)} requests are unfinished")
        self.step += n

    # --- queries --------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id (finished ones are forgotten)."""
        return self.requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._group)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            step=self.step,
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            num_swapped=len(self.swapped),
            kv_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            num_batched_tokens=self._last_batched,
            num_preemptions=self._last_preemptions,
            num_preemptions_total=self._preemptions_total,
            prefix_cache_hit_rate=(bm.num_cache_hits / bm.num_cache_queries
                                   if bm.num_cache_queries else 0.0),
        )

    def consistency_violations(self) -> list[tuple[str | None, str]]:
        """Every disagreement between the scheduler's and the block manager's books, as
        (offending request id or None, message); [] when they balance.

        O(requests + blocks), cheap enough for production to run when the engine is idle
        (LLMEngine.check_health) or after every step under a debug flag.
        """
        bm = self.block_manager
        bad: list[tuple[str | None, str]] = list(bm.consistency_violations())
        running_ids = [r.request_id for r in self.running]
        if len(self.running) > self.config.max_num_seqs:
            bad.append((None, f"{len(self.running)} running, more than max_num_seqs="
                              f"{self.config.max_num_seqs}"))
        waiting = list(self.waiting) + list(self._group)
        swapped = list(self.swapped)
        queued = running_ids + [r.request_id for r in waiting] + [r.request_id for r in swapped]
        known = set(self.requests)
        for rid in sorted(known - set(queued)):
            bad.append((rid, "unfinished but in no queue (lost)"))
        for rid in sorted(set(queued) - known):
            bad.append((rid, "queued but not an unfinished request"))
        counts = collections.Counter(queued)
        bad += [(rid, f"queued {c} times") for rid, c in counts.items() if c > 1]
        bs = bm.block_size
        for r in self.running:
            rid = r.request_id
            if r.status is not _RUNNING:
                bad.append((rid, f"in the running list with status {r.status.value}"))
            if not bm.holds_device_blocks(rid):
                bad.append((rid, "running without a block table"))
            elif bm.num_device_blocks(rid) < cdiv(r.num_computed_tokens, bs):
                bad.append((rid, f"{bm.num_device_blocks(rid)} blocks cannot hold its "
                                 f"{r.num_computed_tokens} computed tokens"))
            if self._granted.get(rid) != bm.num_device_blocks(rid) * bs:
                bad.append((rid, f"granted {self._granted.get(rid)} token slots but holds "
                                 f"{bm.num_device_blocks(rid)} blocks"))
        for r in waiting:
            if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                bad.append((r.request_id, f"waiting with status {r.status.value}"))
            if bm.holds_device_blocks(r.request_id) or r.num_computed_tokens:
                bad.append((r.request_id, "waiting but holds blocks or computed tokens"))
        for r in swapped:
            if r.status is not RequestStatus.SWAPPED or bm.holds_device_blocks(r.request_id):
                bad.append((r.request_id, "swapped but not SWAPPED or holds device blocks"))
            elif bm.num_host_blocks(r.request_id) != cdiv(r.num_computed_tokens, bs):
                bad.append((r.request_id, f"{bm.num_host_blocks(r.request_id)} host blocks for "
                                          f"{r.num_computed_tokens} computed tokens"))
        for rid in sorted(bm.device_owners() - set(running_ids)):
            bad.append((rid, "holds device blocks but is not running"))
        for rid in sorted(set(self._granted) - set(running_ids)):
            bad.append((rid, "granted token slots but not running"))
        return bad

    def check_consistency(self) -> None:
        """Raise AssertionError listing every violation (tests call this after each step)."""
        bad = self.consistency_violations()
        if bad:
            raise AssertionError("; ".join(f"{rid}: {msg}" if rid else msg for rid, msg in bad))
