"""The engine's own Scheduler, driven by a simulated executor on a virtual clock.

No scheduling decision is made here: every step calls `Scheduler.schedule()`, hands the
SchedulerOutput to a `SimExecutor` (which, like the model runner, keeps its own per-request
state built from that data only and "samples" a token for each request whose tokens reach
its end), and hands the tokens back through `Scheduler.update_from_output()`, exactly as the
engine does with the model runner. What the lab adds is bookkeeping: a `Recorder` (only when
asked: per-request output, traces, plots) keeps which slot each running request occupies
and a per-step timeline; `simulate` keeps when each request arrived, got its first token
and finished, and how long each step would take under a cost model.

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
from iterserve.core.cost_model import CostModel
from iterserve.core.request import Request, SamplingParams
from iterserve.core.scheduler import Scheduler
from iterserve.core.scheduler_output import SchedulerOutput
from iterserve.core.spec_decode.ngram import SyntheticAcceptance
from iterserve.core.step_time import attention_pairs
from iterserve.errors import QueueFullError, SLOUnattainableError, SimulationError
from iterserve.lab.workload import RequestSpec

PROMPT_TOKEN = 1       # the token every simulated prompt is made of (so, with prefix
                       # caching on, prompts share their prefixes as far as they go)
SAMPLED_TOKEN = 2      # what the simulated executor "samples"; never an eos (ignore_eos too)
STALL_LIMIT = 10_000   # steps with work queued but nothing scheduled before we give up


@dataclass(frozen=True, slots=True)
class SimSettings:
    """One mode's configs (the engine's own, from the one knob schema) plus the lab's view."""

    scheduler: SchedulerConfig
    cache: CacheConfig
    prefill_ignored: bool

    @property
    def batching(self) -> str:
        return self.scheduler.batching.value

    @property
    def slots(self) -> int:
        """The lab's name for max_num_seqs: a running request occupies one slot."""
        return self.scheduler.max_num_seqs

    @property
    def num_kv_blocks(self) -> int:
        return self.cache.num_kv_blocks

    @property
    def acceptance_rates(self) -> tuple[float, ...] | None:
        """Speculative decoding's per-position acceptance (lab/api.py makes every lab
        speculation `synthetic`), or None with speculation off."""
        spec = self.scheduler.speculative_config
        return tuple(spec["acceptance_rates"]) if spec else None


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


class Recorder:
    """Slots, segments and a per-step timeline: what traces, plots and per-request output
    need. Only built when recording, so big runs pay nothing for it."""

    def __init__(self, slots: int):
        self.slots = slots
        self.free_slots = list(range(slots))        # a heap: lowest index first
        self.tracks: dict[str, _Track] = {}
        self.timeline: dict[str, Any] = {
            "running": [], "waiting": [], "preempted": [], "finished": [], "kv_blocks_used": []}
        self.arrived = self.admitted = self.evicted_now = 0

    def idle(self, gap: int, done: int) -> None:
        for key, value in (("running", 0), ("waiting", 0), ("preempted", 0),
                           ("finished", done), ("kv_blocks_used", 0)):
            self.timeline[key].extend([value] * gap)

    def arrive(self, rid: str, tr: _Track) -> None:
        self.tracks[rid] = tr
        self.arrived += 1

    def evict(self, tr: _Track, step: int, first: bool) -> None:
        if first:
            self.evicted_now += 1
        if tr.slot >= 0:
            tr.segments.append({"slot": tr.slot, "start": tr.seg_start, "end": step,
                                "kind": tr.seg_kind})
            heapq.heappush(self.free_slots, tr.slot)
            tr.slot = -1

    def chunk(self, rid: str, step: int, is_prefill: bool) -> None:
        tr = self.tracks[rid]
        if tr.slot < 0:
            if not self.free_slots:
                raise SimulationError(
                    f"step {step}: the scheduler ran more than max_num_seqs="
                    f"{self.slots} requests at once")
            tr.slot = heapq.heappop(self.free_slots)
            tr.seg_start = step
            tr.seg_kind = "prefill" if is_prefill else "decode"
            if tr.first_scheduled < 0:
                tr.first_scheduled = step
                self.admitted += 1
            if tr.evicted:
                tr.evicted = False
                self.evicted_now -= 1
        elif is_prefill != (tr.seg_kind == "prefill"):
            tr.segments.append({"slot": tr.slot, "start": tr.seg_start, "end": step,
                                "kind": tr.seg_kind})
            tr.seg_start = step
            tr.seg_kind = "prefill" if is_prefill else "decode"

    def end_step(self, sched: Scheduler) -> None:
        tl = self.timeline
        tl["running"].append(self.slots - len(self.free_slots))
        tl["waiting"].append(self.arrived - self.admitted)
        tl["preempted"].append(self.evicted_now)
        st = sched.stats()
        tl["kv_blocks_used"].append(st.num_blocks - st.num_free_blocks)

    def finish(self, rid: str, tr: _Track, end: int) -> None:
        if tr.slot >= 0:
            heapq.heappush(self.free_slots, tr.slot)
            tr.segments.append({"slot": tr.slot, "start": tr.seg_start, "end": end,
                                "kind": tr.seg_kind})
            tr.slot = -1
        del self.tracks[rid]


class SimExecutor:
    """Executes a SchedulerOutput in simulated time, from the data alone (as the runner does).

    Per request it keeps only its token count and prompt length, built from NewRequestData
    and advanced by the token it "samples". `execute` returns the sampled tokens and leaves
    the step's cost-model features (tokens, sequences, KV read, prefill tokens) and its
    duration in `last_*` / `step_seconds`.
    """

    def __init__(self, cost: CostModel, max_num_seqs: int, prefill_ignored: bool,
                 recorder: Recorder | None = None,
                 acceptance: SyntheticAcceptance | None = None):
        self.cost = cost
        self.acceptance = acceptance
        self.max_num_seqs = max_num_seqs
        self.prefill_ignored = prefill_ignored
        # Prefill tokens (and their query-key pairs) only matter to the cost when they
        # have their own price.
        self.price_prefill = cost.c_prefill_tok > 0
        self.price_attn = cost.c_attn > 0
        self.count_prefill = self.price_prefill or self.price_attn or recorder is not None
        self.recorder = recorder
        # request id -> [tokens it has (prompt + outputs), prompt length]: one lookup a chunk.
        self.state: dict[str, list[int]] = {}
        self.last_tokens = 0
        self.step_seconds = 0.0

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        state = self.state
        for rid in out.finished_req_ids:
            state.pop(rid, None)
        for d in out.scheduled_new_reqs:
            state[d.req_id] = [len(d.prompt_token_ids) + len(d.output_token_ids),
                               len(d.prompt_token_ids)]
        sched = out.num_scheduled_tokens
        if len(sched) > self.max_num_seqs:
            raise SimulationError(
                f"step {out.step}: the scheduler ran {len(sched)} requests, more than "
                f"max_num_seqs={self.max_num_seqs}")
        sampled: dict[str, int | list[int]] = {}
        tokens = kv_read = prefill = attn = 0
        rows = len(sched)
        verifying = out.scheduled_spec_decode_tokens
        count_prefill = self.count_prefill
        ignored = self.prefill_ignored
        rec = self.recorder
        step = out.step
        kinds: dict[str, bool] = {}
        for data in (out.scheduled_new_reqs, out.scheduled_cached_reqs):
            for d in data:
                rid = d.req_id
                nt = sched[rid]
                start = d.num_computed_tokens
                end = start + nt
                tokens += nt
                st = state[rid]
                if verifying and rid in verifying:
                    # A verification: nt decode rows (the request's token and its drafts),
                    # row j reading start + j + 1 keys, as the runner computes it and the
                    # speculator's plan prices it (Scheduler._step_shape).
                    rows += nt - 1
                    kv_read += nt * start + nt * (nt + 1) // 2
                    a = self.acceptance.accepted(nt - 1)
                    sampled[rid] = [SAMPLED_TOKEN] * (a + 1)
                    st[0] += a + 1
                    if rec is not None:
                        kinds[rid] = False
                    continue
                kv_read += end
                if end >= st[0]:
                    sampled[rid] = SAMPLED_TOKEN
                    st[0] += 1
                if count_prefill:
                    is_prefill = nt > 1 or (not ignored and start < st[1])
                    if is_prefill:
                        prefill += nt
                        attn += attention_pairs(start, nt)
                    if rec is not None:
                        kinds[rid] = is_prefill
        if rec is not None:                 # slots are handed out in scheduling order
            for rid in sched:
                rec.chunk(rid, step, kinds[rid])
        self.last_tokens = tokens
        cost = self.cost
        if rows == len(sched):
            self.step_seconds = cost.step_time(tokens, rows, kv_read,
                                               prefill if self.price_prefill else 0,
                                               attn if self.price_attn else 0)
        else:
            # The runner's terms see every verification row; the serving overhead is per
            # request (one output each, however many tokens it carries).
            self.step_seconds = (cost.runner_time(tokens, rows, kv_read,
                                                  prefill if self.price_prefill else 0,
                                                  attn if self.price_attn else 0)
                                 + cost.overhead_s + cost.overhead_seq_s * len(sched))
        return sampled
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
    itl_prev: np.ndarray | None = None   # token time pairs (steps) of consecutive tokens
    itl_next: np.ndarray | None = None
    # SLO runs (arrivals in seconds, policy slo): the step each request became visible in,
    # and which ones add_request refused (their finish / first_token entries are 0).
    arrival_step: np.ndarray | None = None
    refused: np.ndarray | None = None
    # Runs with max_queued_requests / request_timeout / queue_timeout: which requests a full
    # queue refused, which ended by timeout, and how many output tokens each got.
    queue_full: np.ndarray | None = None
    timed_out: np.ndarray | None = None
    output_tokens: np.ndarray | None = None
    # Speculative decoding's counters (SpecDecodingStats.to_dict: vLLM's names), or None off.
    spec_decoding: dict[str, Any] | None = None
    # Recorded only when asked (per-request output, trace, plot):
    segments: list[list[dict[str, Any]]] | None = None
    events: list[list[dict[str, Any]]] | None = None
    timeline: dict[str, Any] | None = None


def simulate(specs: list[RequestSpec], settings: SimSettings, cost: CostModel, *,
             record: bool = False, token_gaps: bool = False, seed: int = 0) -> SimResult:
    """Run `specs` (sorted by arrival) through a fresh Scheduler until every request finishes.

    `record` keeps slots, segments, events and a per-step timeline (needed for per-request
    output, traces and plots; costs time on big runs). `token_gaps` keeps every pair of
    consecutive token times for the inter-token-latency percentiles. `seed`: the draws of
    speculative decoding's acceptance.
    """
    now = 0.0

    def clock() -> float:
        return now

    sched = Scheduler(settings.scheduler, settings.cache, clock=clock)
    n = len(specs)
    # --- SLO hook: arrivals in seconds, the policy's clock in simulated seconds, refusals.
    seconds_arrivals = n > 0 and specs[0].arrival_s is not None
    now_s = 0.0
    if sched.slo is not None:
        sched.slo.use_clock(lambda: now_s)
    if sched.spec is not None:             # the adaptive plan refits on simulated seconds
        sched.spec.use_clock(lambda: now_s)
    rates = settings.acceptance_rates
    arrival_step = np.zeros(n, dtype=np.int64) if seconds_arrivals else None
    cfg = settings.scheduler
    bounded = bool(cfg.max_queued_requests)
    refused = (np.zeros(n, dtype=bool)
               if (seconds_arrivals or sched.slo is not None or bounded) else None)
    queue_full = np.zeros(n, dtype=bool) if bounded else None
    timeouts = cfg.request_timeout is not None or cfg.queue_timeout is not None
    timed_out = np.zeros(n, dtype=bool) if timeouts else None
    output_tokens = np.zeros(n, dtype=np.int64) if timeouts else None
    live: dict[str, Request] = {}           # with timeouts: added, not yet finished
    idle_s = cost.idle_step_s if cost.idle_step_s > 0 else 1e-3

    def arrives_later(spec: RequestSpec) -> bool:
        if seconds_arrivals:
            return spec.arrival_s > step_start[-1]
        return spec.arrival > step
    # ---
    finish = np.zeros(n, dtype=np.int64)
    first_token = np.zeros(n, dtype=np.int64)
    first_scheduled = np.full(n, -1, dtype=np.int64)
    preemptions = np.zeros(n, dtype=np.int64)
    gaps_prev: list[np.ndarray] = []
    gaps_next: list[np.ndarray] = []
    segments: list[list[dict[str, Any]]] | None = [[] for _ in range(n)] if record else None
    events: list[list[dict[str, Any]]] | None = [[] for _ in range(n)] if record else None
    rec = Recorder(settings.slots) if record else None
    executor = SimExecutor(cost, settings.slots, settings.prefill_ignored, rec,
                           SyntheticAcceptance(rates, seed) if rates else None)
    execute = executor.execute

    step_start = array("d", [0.0])              # 8 bytes a step
    idx = 0
    step = 0
    busy = 0
    computed = 0
    done = 0
    stalled = 0

    while idx < n or sched.has_unfinished_requests():
        if idx < n and arrives_later(specs[idx]) and not sched.has_unfinished_requests():
            # Nothing can run before the next arrival: skip the empty steps in one go. The
            # scheduler holds no request, so an empty schedule() would change nothing but
            # its step number, which we advance to match.
            if seconds_arrivals:
                # The engine sleeps until the arrival and steps at once: the last empty
                # step ends at the arrival itself, not on the next multiple of idle_s.
                a = specs[idx].arrival_s
                gap = max(1, math.ceil((a - step_start[-1]) / idle_s))
                base = step_start[-1]
                step_start.extend(base + idle_s * k for k in range(1, gap))
                step_start.append(max(a, base))
            else:
                gap = specs[idx].arrival - step
                base, idle = step_start[-1], cost.idle_step_s
                step_start.extend(base + idle * k for k in range(1, gap + 1))
            if rec is not None:
                rec.idle(gap, done)
            step += gap
            sched.skip_idle_steps(gap)
        now = float(step)
        while idx < n and not arrives_later(specs[idx]):
            spec = specs[idx]
            tr = _Track(spec)
            req = Request(
                f"req-{spec.index:06d}",
                [PROMPT_TOKEN] * spec.prompt_len,
                SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=0.0),
                priority=spec.priority,
                arrival_time=float(spec.arrival),
                user_data=tr,
            )
            if seconds_arrivals:
                arrival_step[spec.index] = step
                now_s = spec.arrival_s        # the policy sees it arrive when it arrived
            try:
                sched.add_request(req)
            except QueueFullError as e:       # policy slo or a full queue (429 / 503)
                refused[spec.index] = True
                if queue_full is not None and not isinstance(e, SLOUnattainableError):
                    queue_full[spec.index] = True
                done += 1
                idx += 1
                continue
            finally:
                now_s = step_start[-1]
            if rec is not None:
                rec.arrive(req.request_id, tr)
            if timeouts:
                live[req.request_id] = req
            idx += 1

        out = sched.schedule()
        if out.step != step:
            raise SimulationError(
                f"the scheduler numbered step {out.step} where the lab expected {step}: "
                "schedule() must number its steps 0, 1, 2, ... one per call")
        if out.preempted_req_ids or out.swapped_out_req_ids:
            for rid in (*out.preempted_req_ids, *out.swapped_out_req_ids):
                tr = sched.get_request(rid).user_data
                tr.preemptions += 1
                first = not tr.evicted
                tr.evicted = True
                if rec is not None:
                    rec.evict(tr, step, first)

        if timeouts and out.finished_req_ids:
            # Ended by schedule() itself (a passed deadline): done at this step, with the
            # tokens made so far.
            for rid in out.finished_req_ids:
                req = live.pop(rid, None)
                if req is None:
                    continue
                tr = req.user_data
                i = tr.spec.index
                timed_out[i] = True
                output_tokens[i] = req.num_output_tokens
                finish[i] = step
                first_token[i] = (step if req.first_token_time is None
                                  else int(req.first_token_time))
                first_scheduled[i] = tr.first_scheduled
                preemptions[i] = tr.preemptions
                if token_gaps and req.num_output_tokens > 1:
                    times = np.asarray(req.token_times, dtype=np.int64)
                    gaps_prev.append(times[:-1])
                    gaps_next.append(times[1:])
                if rec is not None:
                    rec.finish(rid, tr, step)
                    segments[i] = tr.segments
                    events[i] = [e.to_dict() for e in req.events]
                req.user_data = None
                done += 1

        sampled = execute(out)
        nseq = len(out.num_scheduled_tokens)
        busy += nseq
        computed += executor.last_tokens
        step_start.append(step_start[-1] + executor.step_seconds)
        if nseq == 0:
            stalled += 1
            if stalled > STALL_LIMIT and sched.has_unfinished_requests():
                raise SimulationError(
                    f"the scheduler scheduled nothing for {STALL_LIMIT} steps while "
                    f"{sched.num_waiting} requests waited (step {step}): the KV pool or the "
                    "token budget cannot fit the next request")
        else:
            stalled = 0
        if rec is not None:
            rec.end_step(sched)

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
            if timeouts:
                live.pop(req.request_id, None)
                output_tokens[i] = req.num_output_tokens
            finish[i] = step + 1
            first_token[i] = int(req.first_token_time)
            first_scheduled[i] = tr.first_scheduled
            preemptions[i] = tr.preemptions
            if token_gaps and req.num_output_tokens > 1:
                times = np.asarray(req.token_times, dtype=np.int64)
                gaps_prev.append(times[:-1])
                gaps_next.append(times[1:])
            if rec is not None:
                rec.finish(req.request_id, tr, step + 1)
                segments[i] = tr.segments
                events[i] = [e.to_dict() for e in req.events]
            req.user_data = None
            done += 1

        if rec is not None:
            rec.timeline["finished"].append(done)
        step += 1

    if done != n:
        raise SimulationError(f"{n - done} of {n} requests never finished")
    timeline = None
    if rec is not None:
        timeline = rec.timeline
        timeline["num_kv_blocks"] = settings.num_kv_blocks
    result = SimResult(
        mode=settings.batching, settings=settings, steps=step, busy_slot_steps=busy,
        computed_tokens=computed, step_start_s=np.frombuffer(step_start, dtype=np.float64),
        specs=specs, finish=finish, first_token=first_token, first_scheduled=first_scheduled,
        preemptions=preemptions, segments=segments, events=events, timeline=timeline,
        arrival_step=arrival_step, refused=refused, queue_full=queue_full,
        timed_out=timed_out, output_tokens=output_tokens,
        spec_decoding=sched.spec.total.to_dict() if sched.spec is not None else None)
    if token_gaps:
        empty = np.zeros(0, dtype=np.int64)
        result.itl_prev = np.concatenate(gaps_prev) if gaps_prev else empty
        result.itl_next = np.concatenate(gaps_next) if gaps_next else empty
    return result
