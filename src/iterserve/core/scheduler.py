"""The iteration-level scheduler: one `schedule()` per step decides what every request runs.

A request is a token list of which `num_computed_tokens` are in the KV cache (see
request.py). Each step the scheduler gives each request a number of tokens to compute: the
whole (or a chunk of the) uncomputed part for a prompt, a recomputed request or a prefix-cache
hit, or 1 for a decode. One loop covers all of them, as in vLLM's v1 core and nano-vllm, and
every policy shares it; what differs between policies (fcfs, priority, slo, static batching)
is asked of a `Policy` (core/policy.py): queue order, admission, victim choice and per-step
hooks. `schedule()` is the step, in parts:

1. Timeouts: requests whose deadline (any state) or queue deadline (never admitted) passed
   end with FinishReason.TIMEOUT. The policy's `begin_step` then gives the step's
   `StepRules` (under `priority`: who yields to a more urgent arrival, who shares a capped
   number of tokens).
2. Running requests and preemption (`_schedule_running`): in the running list's order (the
   policy's `place`), each gets its next chunk within the token budget. When one needs a KV
   block and none is free, the policy's `victim` is preempted (recompute: blocks freed,
   requeued at the front of where it waits; swap: blocks moved to host memory); if it was
   already scheduled this step, its tokens go back to the budget.
3. If nothing was preempted, swap-in (`_swap_in`): swapped requests resume, in the swapped
   queue's order, while blocks allow.
4. If nothing was preempted, admission (`_admit`): requests from the policy's
   `admission_queue` start in its order while the budget, `max_num_seqs`, the prefill caps
   and the KV pool allow, prefix-cache hits claimed first (device blocks, then blocks kept
   in the KV tiers below the pool, core/kv_tiers.py: a request whose next blocks are being
   read back from disk waits one step for them), unless the policy `holds`. When
   slots or blocks run out the policy may give up a running request for the next one
   (`urgent_victim`). `_fit` sizes a first chunk and applies the caps: with
   `max_long_partial_prefills` (vLLM's) below `max_num_partial_prefills`, a long prompt
   (more than `long_prefill_token_threshold` tokens left) over the long cap is passed over,
   keeping its place, and shorter prompts behind it start; likewise, with a threshold set, a
   prompt that would be one partial prefill over `max_num_partial_prefills` is passed over
   for the prompts behind it that complete within the budget left. With
   `max_long_prefill_tokens` the chunks of long prompts (more than the threshold in all)
   take at most that many tokens per step together: the step that ends one long prefill
   starts the next with what is left of it, and a long prompt that finds it spent is passed
   over like one over the long cap.
5. The step's data, its checks, and the policy's `end_step`; `update_from_output` calls its
   `step_done` once the executor has run the step.

Speculative decoding (`speculative_config`, core/spec_decode) adds no part of its own: a
running request's drafts (`Request.spec_token_ids`, proposed when its previous step's tokens
came back) are more tokens of its step, as in vLLM v1. The running part asks the
`Speculator` once per step how many of each request's drafts pay (`plan`), schedules 1 +
that many tokens against the budget and the request's KV blocks like any tokens, and lists
the drafts in `scheduled_spec_decode_tokens`; `update_from_output` appends the tokens the
executor accepted (with the usual stop checks after each), keeps the accepted drafts as
computed, returns the blocks of the rejected ones at once (`BlockManager.trim`) and asks
for the next drafts. A preemption drops a request's drafts.

The step's budget and counters live in one `_Step` that the parts share.

What the executors get is data (scheduler_output.py): a request the executor does not hold
comes once whole, then only as per-step diffs (new block ids, where its tokens start). The
block manager answers allocations with the blocks it added (`KVCacheBlocks`); the scheduler
never reads its tables. `schedule()` ends with cheap asserts (token budget, max_num_seqs).

Per-step cost is O(running requests) with small constants: a decode that needs no new block
copies nothing, nothing is recorded per decode step, the policy is asked a fixed number of
questions per step (its rules are data the loop reads, not a call per request), queues are
a deque or a heap with lazy removal, and timeouts sit in a heap keyed by time.
"""

from __future__ import annotations

import collections
import heapq
import time
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

from iterserve.core.block_manager import BlockManager, cdiv
from iterserve.core.config import (
    Batching, CacheConfig, PreemptionMode, SchedulerConfig, SchedulingPolicy)
from iterserve.core.kv_tiers import PrefixHit
from iterserve.core.policy import FcfsPolicy, Policy, StepRules
from iterserve.core.priority_policy import PriorityPolicy
from iterserve.core.request import FinishReason, Request, RequestStatus
from iterserve.core.request_queue import RequestQueue
from iterserve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from iterserve.core.slo_policy import SloPolicy
from iterserve.core.spec_decode import (
    DRAFT_PLACEHOLDER, SpecDecodingStats, SpeculativeConfig, Speculator)
from iterserve.core.spec_decode.adaptive import StepShape
from iterserve.core.static_batching import StaticBatching
from iterserve.core.step_time import attention_pairs
from iterserve.errors import QueueFullError

_RUNNING = RequestStatus.RUNNING


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
    # speculative decoding: the last step's verifications, and all of them so far (None off)
    spec_decoding: SpecDecodingStats | None = None
    spec_decoding_total: SpecDecodingStats | None = None


def make_policy(config: SchedulerConfig, clock: Callable[[], float]) -> Policy:
    """The policy a (validated) `SchedulerConfig` names; `clock` is the scheduler's."""
    if config.scheduling_policy is SchedulingPolicy.PRIORITY:
        policy: Policy = PriorityPolicy(config)
    elif config.scheduling_policy is SchedulingPolicy.SLO:
        policy = SloPolicy(config, clock)
    else:
        policy = FcfsPolicy(config)
    if config.batching is Batching.STATIC:
        policy = StaticBatching(policy, config.max_num_seqs)
    return policy


class _Step:
    """The step being scheduled: what is left of its budget and what it has done so far.

    One per schedule() call, shared by its parts. The running part, which visits every
    running request every step, copies the fields it uses into locals and writes them back.
    (A plain class: its construction is part of every step's fixed cost.)
    """

    __slots__ = ("out", "now", "rules", "budget", "long_left", "share_left", "new", "shared",
                 "share_skipped", "num_partial", "num_long", "num_preempted")

    def __init__(self, out: SchedulerOutput, now: float, rules: StepRules, budget: int,
                 long_left: int) -> None:
        self.out = out
        self.now = now
        self.rules = rules
        self.budget = budget              # tokens left of max_num_batched_tokens
        self.long_left = long_left        # left of max_long_prefill_tokens (when it is set)
        self.share_left = rules.share_tokens
        self.new: dict[str, NewRequestData] = {}    # requests sent whole this step
        self.shared: list[Request] = []   # running requests scheduled out of the share
        self.share_skipped = False        # one sat out because the share was spent
        self.num_partial = 0              # requests still mid-prefill after this step
        self.num_long = 0                 # of those, long ones (max_long_partial_prefills)
        self.num_preempted = 0


class _Fit(NamedTuple):
    """A waiting request's first chunk this step, and the caps it counts against."""

    tokens: int
    num_hit: int                 # prompt tokens served from the prefix cache
    hits: PrefixHit              # their blocks (device, then RAM tier)
    shared: bool                 # out of the step's share (StepRules)
    long_req: bool               # against max_long_prefill_tokens
    partial: bool                # still mid-prefill after this step
    is_long: bool                # a long partial prefill (max_long_partial_prefills)


_PASS = "pass"        # _fit: this request waits, but those behind it may start


class Scheduler:
    """Decides, step by step, which tokens of which requests the executor computes.

    `policy`: the `Policy` to decide with instead of the one `config` names (make_policy);
    one per scheduler, since a policy keeps the scheduler's queues."""

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig,
                 clock: Callable[[], float] = time.monotonic,
                 policy: Policy | None = None) -> None:
        self.config = config.validate()
        self.cache_config = cache_config.validate()
        self.clock = clock
        self.block_manager = BlockManager(
            cache_config.num_kv_blocks, cache_config.block_size, cache_config.num_swap_blocks,
            cache_config.enable_prefix_caching, cache_config.num_ram_tier_blocks,
            cache_config.num_disk_tier_blocks)
        self.step = 0
        self.requests: dict[str, Request] = {}          # every unfinished request
        self.running: list[Request] = []                # the policy's order (`place`)
        self.policy: Policy = policy if policy is not None else make_policy(self.config, clock)
        self.waiting = self.policy.waiting
        self.swapped = self.policy.swapped
        # The slo policy itself (its clock, step-time model and counters) for the lab and
        # the engine's stats; None under the other policies.
        self.slo = self.policy.slo
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
        # Requests whose state the executors hold (sent as NewRequestData and not finished
        # or preempted by recompute since): a swapped-in one of these comes back as a diff.
        self._sent: set[str] = set()
        # Token slots each running request was granted, from the block manager's answers
        # (blocks held x block_size): a step that fits asks the block manager nothing.
        self._granted: dict[str, int] = {}
        # (time, seq, is_queue_deadline, request): checked at the start of schedule().
        self._timeouts: list[tuple[float, int, bool, Request]] = []
        self._timeout_seq = 0
        self._ended: list[str] = []          # ended by finish_request, for the next output
        self._finished: list[str] = []       # every request finished since the last output
        self._last_batched = 0
        self._last_preemptions = 0
        self._preemptions_total = 0
        # Speculative decoding (core/spec_decode): None when off.
        spec = SpeculativeConfig.parse(config.speculative_config)
        self.spec: Speculator | None = (
            Speculator(spec, config.max_model_len, clock) if spec is not None else None)
        self._last_spec: SpecDecodingStats | None = None
        self._truncated: dict[str, int] = {}     # tables cut since the last output

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
        self.policy.check_request(request)
        n = request.num_prompt_tokens
        pooling = request.pooling_params is not None
        if n > cfg.max_model_len or (n == cfg.max_model_len and not pooling):
            self._reject(request, now, "prompt_too_long")
            raise ValueError(
                f"request {rid!r}: the prompt has {n} tokens but max_model_len is "
                f"{cfg.max_model_len}" + ("" if pooling else
                                          "; it must be shorter to leave room for an output "
                                          "token"))
        # The last sampled token is never computed, so a request holds at most len - 1 tokens;
        # a pooling request computes its whole prompt and no more.
        final_len = n + 1 if pooling else \
            min(n + request.sampling_params.max_tokens, cfg.max_model_len)
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
        try:
            self.policy.on_add(request)
        except QueueFullError:
            self._reject(request, now, self.policy.refusal_reason or "queue_full")
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
    def finish_request(self, request_id: str, reason: FinishReason, *,
                       num_output_tokens: int | None = None) -> Request | None:
        """End a request in any state (abort, stop string, error) and free all it holds.

        Idempotent: None for unknown or already finished ids. The request is listed in the
        next SchedulerOutput.finished so executors can drop per-request state.
        `num_output_tokens`: keep only that many output tokens (a stop string inside the
        tokens a verification appended: Request.truncate_output).
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if num_output_tokens is not None:
            request.truncate_output(num_output_tokens)
        status = request.status
        if status is _RUNNING:
            self.running.remove(request)
        elif status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        self.block_manager.free(request)
        self._finish(request, reason, self.clock())     # (a waiting one: the policy's)
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
        self._truncated.pop(request.request_id, None)
        self.policy.forget(request)
        if self.spec is not None:
            self.spec.forget(request)

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
        """Pick this step's tokens. Call once per step, then update_from_output().

        The step: timeouts; the finished lists for the executors; the policy's rules for
        this step; running requests (and the preemptions that make room for them); then,
        unless something had to be preempted, swap-in and admission; the step's data, its
        checks and the policy's end-of-step hook."""
        cfg = self.config
        policy = self.policy
        now = self.clock()
        out = SchedulerOutput(step=self.step)
        if self._timeouts and self._timeouts[0][0] <= now:
            self._expire_timeouts(now)
        if self._finished:
            out.finished_req_ids = self._finished
            self._finished = []
        if self._ended:
            out.ended_req_ids = self._ended
            self._ended = []
        if self._truncated:
            out.truncated_block_tables = self._truncated
            self._truncated = {}
        rules = policy.begin_step(self.step, self.running)
        st = _Step(out, now, rules, cfg.max_num_batched_tokens, self._long_tokens)

        self._schedule_running(st)
        if not st.num_preempted:        # a step that had to preempt has no room for more
            if self.swapped:
                self._swap_in(st)
            source = policy.admission_queue(not self.running and not self.swapped)
            if source:
                self._admit(st, source)

        if st.share_skipped and st.shared:
            self._rotate_share(st.shared)
        out.kv_tiers = self.block_manager.end_step()
        if st.new:
            out.scheduled_new_reqs = list(st.new.values())
            self._sent.update(st.new)
        out.num_batched_tokens = cfg.max_num_batched_tokens - st.budget
        # Cheap end-of-step checks (vLLM v1 does the same): a broken invariant here would
        # otherwise surface far away, as a wrong token or a leaked block.
        assert st.budget >= 0, f"step {out.step} overran the token budget by {-st.budget}"
        max_seqs = cfg.max_num_seqs
        assert len(out.num_scheduled_tokens) <= max_seqs and len(self.running) <= max_seqs, (
            f"step {out.step} runs {len(self.running)} requests, max_num_seqs is {max_seqs}")
        self._last_batched = out.num_batched_tokens
        self._last_preemptions = st.num_preempted
        self._preemptions_total += st.num_preempted
        if self.spec is not None and self.spec.adaptive:
            self.spec.begin_step(self._step_shape(out))
        policy.end_step(out, self.requests)
        return out

    def _step_shape(self, out: SchedulerOutput) -> StepShape:
        """The scheduled step in the cost model's features, as the runner computes it (a
        verification is 1 + k decode rows; a chunk of more than one token, or of a prompt,
        is a prefill chunk), for the speculator's online step-time model."""
        shape = StepShape()
        requests = self.requests
        drafts = out.scheduled_spec_decode_tokens
        for rid, n in out.num_scheduled_tokens.items():
            req = requests[rid]
            start = req.num_computed_tokens
            if rid in drafts:
                shape.seqs += n
                shape.kv += n * start + n * (n + 1) // 2
            elif n > 1 or start < len(req.prompt_token_ids):
                shape.seqs += 1
                shape.kv += start + n
                shape.prefill += n
                shape.attn += attention_pairs(start, n)
            else:
                shape.seqs += 1
                shape.kv += start + 1
            shape.tokens += n
        return shape

    def _schedule_running(self, st: _Step) -> None:
        """Running requests, in the running list's order, each get their next chunk.

        A decode is one token; a prompt (or a recompute) the rest of it, up to the chunk
        caps. When a KV block is missing, the policy's victim is preempted until the
        request fits or is itself the victim; tokens a victim was given earlier in this
        step go back to the budget. Requests the step's rules exclude sit the step out.
        """
        running = self.running
        out = st.out
        # Speculative decoding: how many of each running request's drafts to verify.
        drafts = self.spec.plan(running, out.step, st.budget) if self.spec is not None \
            else None
        spec_out = out.scheduled_spec_decode_tokens
        num_sched = out.num_scheduled_tokens          # filled in scheduling order
        cached = out.scheduled_cached_reqs            # (a list: appended once per request)
        granted = self._granted
        allocate = self.block_manager.allocate_slots
        block_size = self.block_manager.block_size
        clamp = self._clamp
        victim_of = self.policy.victim
        now, step = st.now, out.step
        threshold, long_cap = self._threshold, self._long_tokens
        yield_below, share_below = st.rules.yield_below, st.rules.share_below
        budget, long_left, share_left = st.budget, st.long_left, st.share_left
        num_partial = num_long = num_preempted = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            start = req.num_computed_tokens
            num_tokens = len(req.all_token_ids)      # (properties cost ~2x on this path)
            n = num_tokens - start
            if yield_below is not None and req.priority > yield_below:
                i += 1                      # yields this step to a more urgent arrival
                continue
            shared = share_below is not None and req.priority > share_below
            if shared and share_left <= 0:
                st.share_skipped = True
                i += 1                      # the less urgent share of this step is spent
                continue
            k = drafts.get(req.request_id, 0) if drafts else 0
            if k:
                # Its drafts are more tokens of its step (vLLM's num_tokens_with_spec):
                # as many as the budget (or the share) leaves, down to none.
                cap = share_left if shared and share_left < budget else budget
                n = min(1 + k, cap)
                k = n - 1
            elif n > 1:
                if threshold and n > threshold:
                    num_long += 1           # a long prefill (or recompute) mid-way
                cap = share_left if shared and share_left < budget else budget
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
                    victim = victim_of(running)
                    idx = running.index(victim)
                    if idx < i:
                        i -= 1
                    budget += self._preempt(victim, idx, st)
                    num_preempted += 1
                    if victim is req:
                        break
                if blocks is None:
                    continue                # running[i] is now the next request
                new_blocks = blocks.block_ids
                granted[rid] += len(new_blocks) * block_size
            num_sched[rid] = n
            cached.append(CachedRequestData(rid, new_blocks, start))
            if k:
                spec_out[rid] = req.spec_token_ids[:k]
            budget -= n
            if shared:
                share_left -= n
                st.shared.append(req)
            if start + n < num_tokens:          # still mid-prefill after this step
                num_partial += 1
                req.record("prefill_chunk", now, step, start=start, num_tokens=n)
            elif not k and (n > 1 or start < len(req.prompt_token_ids)):
                req.record("prefill_chunk", now, step, start=start, num_tokens=n)
            i += 1
        st.budget, st.long_left, st.share_left = budget, long_left, share_left
        st.num_partial, st.num_long, st.num_preempted = num_partial, num_long, num_preempted

    def _swap_in(self, st: _Step) -> None:
        """Swapped requests resume, in the policy's order, while slots, the budget and
        blocks allow: before new work, since their KV is already computed."""
        bm = self.block_manager
        swapped, running, out = self.swapped, self.running, st.out
        share_below = st.rules.share_below
        now, step = st.now, out.step
        while st.budget > 0 and len(running) < self.config.max_num_seqs:
            req = swapped.peek()
            if req is None:
                break
            start = req.num_computed_tokens
            shared = share_below is not None and req.priority > share_below
            n = self._clamp(req.num_tokens - start,
                            min(st.budget, st.share_left) if shared else st.budget)
            if not n or not bm.can_swap_in(req, n):
                break
            swapped.pop()
            out.blocks_to_swap_in.extend(bm.swap_in(req))
            ok = bm.allocate_slots(req, n)
            assert ok is not None, "swap-in fit check and allocation disagree"
            req.status = _RUNNING
            self.policy.place(running, req)
            rid = req.request_id
            out.swapped_in_req_ids.append(rid)
            req.record("swapped_in", now, step)
            req.record("resumed", now, step)
            out.num_scheduled_tokens[rid] = n
            table = bm.get_blocks(rid).block_ids
            self._granted[rid] = len(table) * bm.block_size
            if rid in self._sent:
                out.scheduled_cached_reqs.append(CachedRequestData(rid, table, start, True))
            else:                       # swapped out the step it was admitted
                st.new[rid] = self._new_data(req, table)
            st.budget -= n
            if shared:
                st.share_left -= n
                st.shared.append(req)
            if start + n < req.num_tokens:
                st.num_partial += 1

    def _admit(self, st: _Step, source: RequestQueue) -> None:
        """Requests of `source` start, in the policy's order, while slots, the budget, the
        prefill caps and KV blocks allow; when slots or blocks run out, the policy may
        preempt a running request for the next one (`urgent_victim`).

        A prompt held back by a cap the ones behind it need not be (see `_fit`) keeps its
        place; from then on the queue is read in order from a snapshot, and admitted
        requests are taken out of it."""
        policy = self.policy
        running, swapped = self.running, self.swapped
        preempted = st.out.preempted_req_ids
        max_seqs = self.config.max_num_seqs
        scan = None
        retry = None            # (scan mode) the request to try again after a preemption
        while st.budget > 0:
            if retry is not None:
                req, retry = retry, None
            else:
                req = source.peek() if scan is None else next(scan, None)
            if req is None or req.status is RequestStatus.PREEMPTED and \
                    req.request_id in preempted:
                break                   # never re-admit a victim of this very step
            if swapped and not policy.overtakes_swapped(req, swapped.peek()):
                break                   # swapped requests resume before new work
            if running and policy.holds(req, running):
                break
            if len(running) < max_seqs:
                fit = self._fit(req, st)
                if fit is None:
                    break
                if fit is _PASS:
                    if scan is None:
                        scan = iter([r for r in source if r is not req])
                    continue
                blocks = self.block_manager.allocate_slots(req, fit.tokens, fit.hits)
                if blocks is not None:
                    if scan is None:
                        source.pop()
                    else:
                        source.take(req)
                    self._start(req, fit, blocks.block_ids, st)
                    continue
            if not self._preempt_for(req, st):
                break
            retry = req if scan is not None else None

    def _fit(self, req: Request, st: _Step) -> _Fit | str | None:
        """Waiting `req`'s first chunk this step; None when neither it nor any request
        behind it can start, _PASS when it must wait but those behind it may start.

        Passed over, keeping its place: a long prompt (more than long_prefill_token_threshold
        tokens) that finds max_long_prefill_tokens spent by the long chunks already in this
        step, or that would be one long partial prefill over max_long_partial_prefills
        (vLLM's), and, with a threshold set, any prompt that would be one partial prefill
        over max_num_partial_prefills: the prompts behind it that complete within the budget
        left start now (else that budget idles while they wait behind it)."""
        share_below = st.rules.share_below
        shared = share_below is not None and req.priority > share_below
        if shared and st.share_left <= 0:
            return None                 # (queue order: the rest are no more urgent)
        bm = self.block_manager
        threshold = self._threshold
        hits = bm.find_prefix_hit(req)      # device blocks, then RAM tier blocks (kv_tiers)
        if hits.promoting:
            return _PASS                    # its next blocks come back from disk this step
        num_hit = hits.num_blocks * bm.block_size
        left = req.num_tokens - num_hit
        cap = st.share_left if shared and st.share_left < st.budget else st.budget
        long_req = bool(self._long_tokens) and left > 1 and req.num_tokens > threshold
        if long_req and st.long_left < cap:
            if st.long_left <= 0:
                return _PASS
            cap = st.long_left
        n = self._clamp(left, cap)
        if not n:
            return None
        partial = num_hit + n < req.num_tokens
        if partial and st.num_partial >= self.config.max_num_partial_prefills:
            return _PASS if threshold else None
        is_long = bool(self._max_long) and left > threshold
        if is_long and st.num_long >= self._max_long:
            return _PASS
        return _Fit(n, num_hit, hits, shared, long_req, partial, is_long)

    def _start(self, req: Request, fit: _Fit, block_ids: tuple[int, ...], st: _Step) -> None:
        """Admit `req` (already out of its queue) with its first chunk; `block_ids` is its
        whole table (it was empty: the blocks added, prefix-cache hits included)."""
        now, step = st.now, st.out.step
        num_hit, n = fit.num_hit, fit.tokens
        req.num_computed_tokens = num_hit
        req.status = _RUNNING
        self.policy.place(self.running, req)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            req.num_cached_tokens = num_hit
            self.block_manager.note_cache_query(req)
            req.record("scheduled", now, step, num_cached_tokens=num_hit)
        else:
            req.record("resumed", now, step, num_cached_tokens=num_hit)
        rid = req.request_id
        st.out.num_scheduled_tokens[rid] = n
        st.new[rid] = self._new_data(req, block_ids)
        self._granted[rid] = len(block_ids) * self.block_manager.block_size
        req.record("prefill_chunk", now, step, start=num_hit, num_tokens=n)
        st.budget -= n
        if fit.shared:
            st.share_left -= n
        if fit.long_req:
            st.long_left -= n
        if fit.partial:
            st.num_partial += 1
            if fit.is_long:
                st.num_long += 1

    def _preempt_for(self, req: Request, st: _Step) -> bool:
        """Preempt the running request the policy gives up for waiting `req`, if any.

        Requests swapped in this very step are not candidates (their swap-in copy and a
        swap-out copy would race in the executor). The victim's tokens go back to the
        budget (rare: the budget and partial prefills are recounted)."""
        running = self.running
        # (and those loading from the RAM tier this step, for the same reason)
        exclude = self.block_manager.loading_request_ids.union(st.out.swapped_in_req_ids)
        candidates = [r for r in running if r.request_id not in exclude] if exclude else running
        victim = self.policy.urgent_victim(req, candidates)
        if victim is None:
            return False
        self._preempt(victim, running.index(victim), st)
        st.num_preempted += 1
        # A scheduled request's num_computed_tokens is still where its tokens start.
        used = partial = 0
        requests = self.requests
        for rid, n in st.out.num_scheduled_tokens.items():
            used += n
            r = requests[rid]
            if r.num_computed_tokens + n < r.num_tokens:
                partial += 1
        st.budget, st.num_partial = self.config.max_num_batched_tokens - used, partial
        return True

    def _rotate_share(self, shared: list[Request]) -> None:
        """Round robin within the step's share: the requests that ran out of it go to the
        back of their class, so the ones that sat out run first next step."""
        done = {r.request_id for r in shared}
        running = self.running
        running[:] = [r for r in running if r.request_id not in done]
        for r in shared:
            if r.status is _RUNNING:
                self.policy.place(running, r)

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
                              block_ids, req.num_computed_tokens, list(req.output_token_ids),
                              req.pooling_params)

    def _preempt(self, victim: Request, idx: int, st: _Step) -> int:
        """Evict running[idx] (== victim); returns the tokens it had been given this step."""
        del self.running[idx]
        rid = victim.request_id
        self._granted.pop(rid, None)            # its device blocks go either way
        out = st.out
        given = out.num_scheduled_tokens.pop(rid, 0)
        if given:                           # scheduled earlier this step: withdraw its data
            if st.new.pop(rid, None) is None:
                out.scheduled_cached_reqs[:] = [
                    d for d in out.scheduled_cached_reqs if d.req_id != rid]
            out.scheduled_spec_decode_tokens.pop(rid, None)
        victim.spec_token_ids = []          # proposed again after its next step
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
            self.policy.requeue(victim)
            out.preempted_req_ids.append(rid)
            self._sent.discard(rid)
            victim.record("preempted", now, self.step, mode="recompute")
        return given

    def update_from_output(self, output: SchedulerOutput,
                           sampled: Mapping[str, int | list[int]]) -> list[Request]:
        """Apply a step's results: advance computed tokens, append sampled tokens, finish
        requests on length / eos / stop token. Returns the requests finished here.

        `sampled`: a request's token, or, for one that verified drafts, its tokens (the
        accepted drafts and the executor's own, `SampleResult.token_ids`)."""
        self.policy.step_done(self.running)
        now = self.clock()
        bm = self.block_manager
        caching = bm.enable_prefix_caching
        max_len = self.config.max_model_len
        requests = self.requests
        finished: list[Request] = []
        spec = self.spec
        if spec is not None:
            spec.step_done()
        verifying = output.scheduled_spec_decode_tokens
        for rid, n in output.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue                    # ended by finish_request after schedule()
            if verifying and rid in verifying:
                reason = self._apply_verified(req, verifying[rid], sampled.get(rid), now)
                if reason is None:
                    spec.propose(req)
                    continue
                del requests[rid]
                bm.free(req)
                self._finish(req, reason, now)
                finished.append(req)
                continue
            start = req.num_computed_tokens
            computed = start + n
            req.num_computed_tokens = computed
            if caching:
                bm.cache_full_blocks(req)
            all_tokens = req.all_token_ids
            if computed < len(all_tokens):
                continue                    # a prefill chunk that did not reach the end
            if req.pooling_params is not None:
                # Pooled: its prompt is computed and nothing is sampled (the executor's
                # vector goes to the engine, not here); it ends now, its blocks freed.
                del requests[rid]
                bm.free(req)
                self._finish(req, FinishReason.STOP, now)
                finished.append(req)
                continue
            token = sampled.get(rid)
            if token is None:
                raise ValueError(
                    f"the executor returned no token for request {rid!r}, whose chunk "
                    f"[{start}, {computed}) reached its last token")
            if not isinstance(token, int):
                if len(token) != 1:
                    raise ValueError(f"the executor returned {len(token)} tokens for request "
                                     f"{rid!r}, which verified no drafts")
                token = token[0]
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
                if spec is not None:
                    spec.propose(req)
                continue
            del requests[rid]
            bm.free(req)
            self._finish(req, reason, now)
            finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        if spec is not None:
            self._last_spec = spec.end_update()
        self.step += 1
        return finished

    def _apply_verified(self, req: Request, drafts: list[int], tokens: int | list[int] | None,
                        now: float) -> FinishReason | None:
        """A verification's tokens: appended one by one, each with the stop checks (what
        follows a stop is dropped); the accepted drafts' KV is kept, the blocks past it go
        back to the pool. The reason the request finished, or None."""
        rid = req.request_id
        if tokens is None:
            raise ValueError(f"the executor returned no token for request {rid!r}, which "
                             f"verified {len(drafts)} drafts")
        if isinstance(tokens, int):
            tokens = [tokens]
        k = len(drafts)
        accepted = len(tokens) - 1
        if not 0 <= accepted <= k or (drafts[0] != DRAFT_PLACEHOLDER
                                      and list(tokens[:accepted]) != drafts[:accepted]):
            raise ValueError(f"the executor returned tokens {list(tokens)} for request "
                             f"{rid!r}, which verified drafts {drafts}: expected the accepted "
                             "drafts and one token of its own")
        self.spec.verified(req, k, accepted)
        sp = req.sampling_params
        outputs, all_tokens = req.output_token_ids, req.all_token_ids
        max_len = self.config.max_model_len
        reason = None
        for token in tokens:
            outputs.append(token)
            all_tokens.append(token)
            req.token_times.append(now)
            if len(outputs) >= sp.max_tokens or len(all_tokens) >= max_len:
                reason = FinishReason.LENGTH
            elif token == req.eos_token_id and not sp.ignore_eos:
                reason = FinishReason.STOP
            elif sp.stop_token_ids and token in sp.stop_token_ids:
                reason = FinishReason.STOP
            if reason is not None:
                break
        # The last known token and the accepted drafts are computed; the rest was rejected.
        req.num_computed_tokens = len(all_tokens) - 1
        if reason is not None:
            return reason
        bm = self.block_manager
        freed = bm.trim(req, req.num_computed_tokens)
        if freed:
            self._granted[rid] -= freed * bm.block_size
            self._truncated[rid] = bm.num_device_blocks(rid)
        if bm.enable_prefix_caching:
            bm.cache_full_blocks(req)
        return None

    def limit_drafts(self, request_id: str, n: int) -> None:
        """Keep only the first `n` drafts proposed for the request's next step (the engine:
        a structured-output grammar takes no more of them)."""
        req = self.requests.get(request_id)
        if req is not None and len(req.spec_token_ids) > n:
            del req.spec_token_ids[n:]

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
        return self.policy.num_waiting

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
            spec_decoding=self._last_spec,
            spec_decoding_total=self.spec.total if self.spec is not None else None,
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
        waiting = list(self.policy.waiting_requests())
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
