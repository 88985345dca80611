"""The engine's own Scheduler, driven by a simulated executor on a virtual clock.

No scheduling decision is made here: every step calls `Scheduler.schedule()`, "computes"
the chunks it returns (each chunk that reaches a request's last known token yields one
sampled token), and hands the tokens back through `Scheduler.update_from_output()`, exactly
as the engine does with the model runner. What the lab adds is bookkeeping: which slot each
running request occupies, when it arrived, got its first token and finished, and how long
each step would take under a cost model.

The virtual clock counts steps. While step s is scheduled the clock reads s; the tokens of
step s are appended at the end of the step, when it reads s + 1. So a request admitted at
the start of step s with L output tokens (and a free 1-token prompt) produces tokens in
steps s .. s+L-1, finishes at s+L, and its slot is free for step s+L. Seconds come from the
cost model: `step_start_s[t]` is when step t starts, so a time t in steps is
`step_start_s[t]` seconds.

Slots are the lab's view of the batch: a request takes the lowest free slot index when it
becomes running and gives it back when it finishes or is preempted.
"""

from __future__ import annotations

import heapq
import math
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.request import Request, SamplingParams
from iterserve.core.scheduler import QueueFullError, Scheduler
from iterserve.lab.cost_model import CostModel
from iterserve.lab.workload import RequestSpec

PROMPT_TOKEN = 1       # the token every simulated prompt is made of (prefix caching is off)
SAMPLED_TOKEN = 2      # what the simulated executor "samples"; never an eos (ignore_eos too)
STALL_LIMIT = 10_000   # steps with work queued but nothing scheduled before we give up


class SimulationError(RuntimeError):
    """The scheduler broke an invariant the lab relies on (a bug to report, not bad input)."""


@dataclass(frozen=True, slots=True)
class SimSettings:
    batching: str                       # "static" | "continuous"
    slots: int                          # max_num_seqs
    max_num_batched_tokens: int
    max_model_len: int
    chunked_prefill: bool
    num_kv_blocks: int
    block_size: int
    preemption_mode: str                # "recompute" | "swap"
    policy: str                         # "fcfs" | "priority" | "slo"
    prefill_ignored: bool
    slo_ttft_ms: float | None = None    # targets (policy slo admits by them; goodput for all)
    slo_tpot_ms: float | None = None

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.slots,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=self.chunked_prefill,
            scheduling_policy=self.policy,
            batching=self.batching,
            preemption_mode=self.preemption_mode,
            slo_ttft_ms=self.slo_ttft_ms,
            slo_tpot_ms=self.slo_tpot_ms,
        ).validate()

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            # Swap needs a host pool; as large as the device pool, so swap never fails for room.
            num_swap_blocks=self.num_kv_blocks if self.preemption_mode == "swap" else 0,
            enable_prefix_caching=False,
        ).validate()


class _Track:
    """The lab's record of one request while it runs (kept in `request.user_data`)."""

    __slots__ = ("spec", "slot", "seg_start", "seg_kind", "segments", "first_scheduled",
                 "preemptions", "evicted")

    def __init__(self, spec: RequestSpec):
        self.spec = spec
        self.slot = -1
        self.seg_start = 0
        self.seg_kind = ""
        self.segments: list[dict[str, Any]] = []
        self.first_scheduled = -1
        self.preemptions = 0
        self.evicted = False


@dataclass
class SimResult:
    """Everything one simulated run measured; `metrics.summarize` turns it into a report."""

    mode: str
    settings: SimSettings
    steps: int
    busy_slot_steps: int
    computed_tokens: int                 # prompt (and recompute) tokens + decodes
    step_start_s: np.ndarray             # len steps + 1; step t starts at step_start_s[t]
    specs: list[RequestSpec]
    finish: np.ndarray                   # per request, in steps
    first_token: np.ndarray              # per request, in steps (end of the step that made it)
    first_scheduled: np.ndarray          # per request, in steps
    preemptions: np.ndarray              # per request
    # SLO runs (arrivals in seconds, policy slo): the step each request became visible in,
    # and which ones add_request refused (their finish / first_token entries are 0).
    arrival_step: np.ndarray | None = None
    refused: np.ndarray | None = None
    itl_prev: np.ndarray | None = None   # token time pairs (steps) of consecutive tokens
    itl_next: np.ndarray | None = None
    # Recorded only when asked (per-request output, trace, plot):
    segments: list[list[dict[str, Any]]] | None = None
    events: list[list[dict[str, Any]]] | None = None
    timeline: dict[str, Any] | None = None


def simulate(specs: list[RequestSpec], settings: SimSettings, cost: CostModel, *,
             record: bool = False, token_gaps: bool = False) -> SimResult:
    """Run `specs` (sorted by arrival) through a fresh Scheduler until every request finishes.

    `record` keeps slots, segments, events and a per-step timeline (needed for per-request
    output, traces and plots; costs time on big runs). `token_gaps` keeps every pair of
    consecutive token times for the inter-token-latency percentiles.
    """
    now = 0.0

    def clock() -> float:
        return now

    sched = Scheduler(settings.scheduler_config(), settings.cache_config(), clock=clock)
    n = len(specs)
    # --- SLO hook: arrivals in seconds, the policy's clock in simulated seconds, refusals.
    seconds_arrivals = n > 0 and specs[0].arrival_s is not None
    now_s = 0.0
    if sched.slo is not None:
        sched.slo.use_clock(lambda: now_s)
    arrival_step = np.zeros(n, dtype=np.int64) if seconds_arrivals else None
    refused = np.zeros(n, dtype=bool) if (seconds_arrivals or sched.slo is not None) else None
    num_refused = 0
    # ---
    finish = np.zeros(n, dtype=np.int64)
    first_token = np.zeros(n, dtype=np.int64)
    first_scheduled = np.full(n, -1, dtype=np.int64)
    preemptions = np.zeros(n, dtype=np.int64)
    gaps_prev: list[np.ndarray] = []
    gaps_next: list[np.ndarray] = []
    segments: list[list[dict[str, Any]]] | None = [[] for _ in range(n)] if record else None
    events: list[list[dict[str, Any]]] | None = [[] for _ in range(n)] if record else None
    timeline: dict[str, list[int]] | None = (
        {"running": [], "waiting": [], "preempted": [], "finished": [], "kv_blocks_used": []}
        if record else None)

    free_slots = list(range(settings.slots))       # a heap: lowest index first
    step_start = array("d", [0.0])              # 8 bytes a step
    step_time = cost.step_time
    prefill_ignored = settings.prefill_ignored
    # Prefill tokens only matter to the fast path's cost when they have their own price.
    count_prefill = cost.c_prefill_tok > 0
    idx = 0
    step = 0
    busy = 0
    computed = 0
    done = 0
    arrived = 0
    admitted = 0
    evicted_now = 0
    stalled = 0
    sampled_token = SAMPLED_TOKEN

    def arrives_later(spec: RequestSpec) -> bool:
        if seconds_arrivals:
            return spec.arrival_s > step_start[-1]
        return spec.arrival > step

    while idx < n or sched.has_unfinished_requests():
        if idx < n and arrives_later(specs[idx]) and not sched.has_unfinished_requests():
            # Nothing can run before the next arrival: skip the empty steps in one go. The
            # scheduler holds no request, so an empty schedule() would change nothing but
            # its step number, which we advance to match.
            if seconds_arrivals:
                idle_s = cost.idle_step_s if cost.idle_step_s > 0 else 1e-3
                gap = max(1, math.ceil((specs[idx].arrival_s - step_start[-1]) / idle_s))
            else:
                gap = specs[idx].arrival - step
            base, idle = step_start[-1], cost.idle_step_s if not seconds_arrivals else idle_s
            step_start.extend(base + idle * k for k in range(1, gap + 1))
            if record:
                for key, value in (("running", 0), ("waiting", 0), ("preempted", 0),
                                   ("finished", done), ("kv_blocks_used", 0)):
                    timeline[key].extend([value] * gap)
            step += gap
            sched.skip_idle_steps(gap)
        now = float(step)
        while idx < n and not arrives_later(specs[idx]):
            spec = specs[idx]
            req = Request(
                f"req-{spec.index:06d}",
                [PROMPT_TOKEN] * spec.prompt_len,
                SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=0.0),
                priority=spec.priority,
                arrival_time=float(spec.arrival),
                user_data=_Track(spec),
            )
            if seconds_arrivals:
                arrival_step[spec.index] = step
                now_s = spec.arrival_s        # the policy sees it arrive when it arrived
            try:
                sched.add_request(req)
            except QueueFullError:            # policy slo: refused early (a 429 in the server)
                refused[spec.index] = True
                num_refused += 1
                done += 1
                idx += 1
                continue
            finally:
                now_s = step_start[-1]
            idx += 1
            arrived += 1

        out = sched.schedule()
        if out.step != step:
            raise SimulationError(
                f"the scheduler numbered step {out.step} where the lab expected {step}: "
                "schedule() must number its steps 0, 1, 2, ... one per call")

        requests = sched.requests
        if out.preempted_req_ids or out.swapped_out_req_ids:
            for req in (requests[rid] for rid in (*out.preempted_req_ids,
                                                   *out.swapped_out_req_ids)):
                tr: _Track = req.user_data
                tr.preemptions += 1
                if not tr.evicted:
                    tr.evicted = True
                    evicted_now += 1
                if tr.slot >= 0:
                    if record:
                        tr.segments.append({"slot": tr.slot, "start": tr.seg_start, "end": step,
                                            "kind": tr.seg_kind})
                    heapq.heappush(free_slots, tr.slot)
                    tr.slot = -1

        # (request, start, num_tokens) per scheduled request: the plain-data output names
        # requests by id; start is where the request's computed tokens stand before the step.
        chunks = [(requests[rid], requests[rid].num_computed_tokens, nt)
                  for rid, nt in out.num_scheduled_tokens.items()]
        sampled: dict[str, int] = {}
        tokens = kv_read = prefill = 0
        if not record:
            # The hot loop of big runs: only what the executor and the cost model need.
            if len(chunks) > settings.slots:
                raise SimulationError(
                    f"step {step}: the scheduler ran {len(chunks)} requests, more than "
                    f"max_num_seqs={settings.slots}")
            for req, start, nt in chunks:
                end = start + nt
                tokens += nt
                kv_read += end
                if end >= len(req.all_token_ids):
                    sampled[req.request_id] = sampled_token
            if count_prefill:
                prefill = sum(nt for req, start, nt in chunks if nt > 1 or (
                    not prefill_ignored and start < len(req.prompt_token_ids)))
        else:
            for req, start, nt in chunks:
                end = start + nt
                tokens += nt
                kv_read += end
                if end >= len(req.all_token_ids):
                    sampled[req.request_id] = sampled_token
                is_prefill = nt > 1 or (not prefill_ignored
                                        and start < len(req.prompt_token_ids))
                if is_prefill:
                    prefill += nt
                tr = req.user_data
                if tr.slot < 0:
                    if not free_slots:
                        raise SimulationError(
                            f"step {step}: the scheduler ran more than max_num_seqs="
                            f"{settings.slots} requests at once")
                    tr.slot = heapq.heappop(free_slots)
                    tr.seg_start = step
                    tr.seg_kind = "prefill" if is_prefill else "decode"
                    if tr.first_scheduled < 0:
                        tr.first_scheduled = step
                        admitted += 1
                    if tr.evicted:
                        tr.evicted = False
                        evicted_now -= 1
                elif is_prefill != (tr.seg_kind == "prefill"):
                    tr.segments.append({"slot": tr.slot, "start": tr.seg_start, "end": step,
                                        "kind": tr.seg_kind})
                    tr.seg_start = step
                    tr.seg_kind = "prefill" if is_prefill else "decode"

        nseq = len(chunks)
        busy += nseq
        computed += tokens
        step_start.append(step_start[-1] + step_time(tokens, nseq, kv_read, prefill))
        if nseq == 0:
            stalled += 1
            if stalled > STALL_LIMIT and sched.has_unfinished_requests():
                raise SimulationError(
                    f"the scheduler scheduled nothing for {STALL_LIMIT} steps while "
                    f"{sched.num_waiting} requests waited (step {step}): the KV pool or the "
                    "token budget cannot fit the next request")
        else:
            stalled = 0

        if record:
            timeline["running"].append(settings.slots - len(free_slots))
            timeline["waiting"].append(arrived - admitted)
            timeline["preempted"].append(evicted_now)
            st = sched.stats()
            timeline["kv_blocks_used"].append(st.num_blocks - st.num_free_blocks)

        now = float(step + 1)
        now_s = step_start[-1]
        finished = sched.update_from_output(out, sampled)
        for req in finished:
            tr = req.user_data
            i = tr.spec.index
            if req.num_output_tokens != tr.spec.output_len:
                raise SimulationError(
                    f"{req.request_id} finished with {req.num_output_tokens} tokens, "
                    f"expected {tr.spec.output_len} (max_tokens, ignore_eos)")
            finish[i] = step + 1
            first_token[i] = int(req.first_token_time)
            first_scheduled[i] = tr.first_scheduled
            preemptions[i] = tr.preemptions
            if token_gaps and req.num_output_tokens > 1:
                times = np.asarray(req.token_times, dtype=np.int64)
                gaps_prev.append(times[:-1])
                gaps_next.append(times[1:])
            if tr.slot >= 0:
                heapq.heappush(free_slots, tr.slot)
                if record:
                    tr.segments.append({"slot": tr.slot, "start": tr.seg_start,
                                        "end": step + 1, "kind": tr.seg_kind})
                tr.slot = -1
            if record:
                segments[i] = tr.segments
                events[i] = [e.to_dict() for e in req.events]
            req.user_data = None
            done += 1

        if record:
            timeline["finished"].append(done)
        step += 1

    if done != n:
        raise SimulationError(f"{n - done} of {n} requests never finished")
    if record:
        timeline["num_kv_blocks"] = settings.num_kv_blocks
    result = SimResult(
        mode=settings.batching, settings=settings, steps=step, busy_slot_steps=busy,
        computed_tokens=computed, step_start_s=np.frombuffer(step_start, dtype=np.float64), specs=specs,
        finish=finish, first_token=first_token, first_scheduled=first_scheduled,
        preemptions=preemptions, segments=segments, events=events, timeline=timeline,
        arrival_step=arrival_step, refused=refused)
    if token_gaps:
        empty = np.zeros(0, dtype=np.int64)
        result.itl_prev = np.concatenate(gaps_prev) if gaps_prev else empty
        result.itl_next = np.concatenate(gaps_next) if gaps_next else empty
    return result
