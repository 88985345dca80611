"""The lab at cluster scale: N replicas, each the engine's own Scheduler, behind the server's
own Router, on simulated time.

    run_cluster_lab({"data_parallel_size": 4, "router": "prefix_aware",
                     "arrival_rate_s": 20, "prompt_len": [20, 100],
                     "prefix_groups": 8, "prefix_len": 512, "enable_prefix_caching": True})

Each replica is what `lab/simulator.py` runs for one engine (a real `Scheduler`, the
`SimExecutor`, the calibrated cost model) with its own clock. One event loop interleaves
them: before an arrival at time t, every replica runs the steps that start before t (a step
that starts at or after t would have seen the request, exactly the single-replica lab's
rule); then each replica's `ReplicaLoad` (running, waiting, KV usage) goes to
`core.router.Router.route`, the code the Ray Serve deployment uses, and the request joins
the chosen replica's scheduler. A replica with nothing to do skips to the arrival in idle
steps as the single lab does, so one replica here reproduces `simulate()` exactly (same
TTFTs and finish times; tests/lab/test_cluster.py checks it).

The schedulers' clock is simulated seconds (the engine's is wall seconds), so every token
time is already in seconds and no per-step table is kept: memory is per live request, not
per step, whatever the replicas' idle gaps. Prompts are real token ids (lab/workload.py's
`prompt_token_ids`): distinct per request, with a group's shared prefix in front in a
shared-prefix workload, so the prefix cache and the prefix-aware router see what they would
see in production.

Reported (`summarize_cluster`): per replica, requests, tokens, busy fraction (seconds in
non-empty steps / the run's makespan), slot utilisation (sequence-seconds / (slots x
makespan)), prefix-cache hit rate (cached / looked-up prompt blocks, as the engine counts
it) and preemptions; for the cluster, throughput, TTFT / ITL / latency percentiles in
seconds, the aggregate hit rate, the router's counters and the SLO goodput when targets are
set. `search_rate` answers "the highest request rate at which p99 TTFT stays under X" and
`search_replicas` "how many replicas for R requests/s at p99 TTFT under X", both by
bisection over full runs.

The option is `data_parallel_size`, the engine's own knob name (every lab option is, so a
setting moves between `iterserve lab` and `iterserve serve` unchanged); `--replicas` is the
lab CLI's short spelling of the same flag, next to the generated
`--data-parallel-size` / `-dp`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence

import numpy as np
from pydantic import ConfigDict, Field, ValidationError, create_model

from iterserve.core.config import ParallelConfig, knob_fields
from iterserve.core.cost_model import CostModel, shipped_cost_model, shipped_cost_models
from iterserve.core.request import Request, SamplingParams
from iterserve.core.router import ReplicaLoad, Router
from iterserve.core.scheduler import Scheduler
from iterserve.errors import LabOptionsError, QueueFullError, SLOUnattainableError, SimulationError
from iterserve.lab.api import LabPlan, plan_lab
from iterserve.lab.options import LabOptions, _field, _message, apply_preset
from iterserve.lab.simulator import STALL_LIMIT, SimExecutor, SimSettings
from iterserve.lab.workload import (
    MAX_LENGTH, RequestSpec, SharedPrefixSpec, prompt_token_ids)

MAX_REPLICAS = 1024
DEFAULT_REPLICAS = 2            # the lab's default (the schema's is 1: one engine)
DEFAULT_PREFIX_PROMPT = [20, 100]   # a shared-prefix run's own prompt part, if none given
SEARCH_ITERATIONS = 8           # bisection steps of search_rate (precision ~ range / 256)

_PARALLEL = {name: k for name, _, k in knob_fields(ParallelConfig)}

# The cluster's own options, next to the single lab's (LabOptions). The parallel knobs are
# generated from core/config.py's ParallelConfig, as lab/options.py does for the scheduler.
CLUSTER_FIELDS: dict[str, tuple[Any, Any]] = {
    "data_parallel_size": _field(_PARALLEL["data_parallel_size"], DEFAULT_REPLICAS,
                                 MAX_REPLICAS),
    "router": _field(_PARALLEL["router"], _PARALLEL["router"].kind.LEAST_LOADED.value, None),
    "prefix_groups": (int, Field(0, ge=0, le=1_000_000, description=(
        "shared-prefix workload: distinct system prompts (0: none)"))),
    "prefix_len": (int, Field(0, ge=0, le=MAX_LENGTH, description=(
        "tokens in each shared prefix, in front of the drawn prompt"))),
    "prefix_zipf": (float, Field(0.0, ge=0, le=10, allow_inf_nan=False, description=(
        "skew of the groups' popularity (0: uniform; s: weight 1/(g+1)^s)"))),
    "search": (Optional[Literal["rate", "replicas"]], Field(None, description=(
        "rate: the highest arrival_rate_s meeting search_p99_ttft_ms; replicas: the fewest "
        "replicas meeting it at arrival_rate_s"))),
    "search_p99_ttft_ms": (Optional[float], Field(None, gt=0, allow_inf_nan=False,
                                                  description="the search's p99 TTFT target")),
    "search_max_replicas": (int, Field(64, ge=1, le=MAX_REPLICAS, description=(
        "search replicas: give up above this many"))),
}

ClusterOptions = create_model(
    "ClusterOptions",
    __config__=ConfigDict(strict=True, extra="forbid"),
    __doc__="The cluster lab's own options (the rest are LabOptions).",
    **CLUSTER_FIELDS,
)

# Single-lab options a cluster run cannot honour, and why.
_REFUSED = {
    "arrival_rate": "is per step, and replicas have their own steps; use arrival_rate_s "
                    "(per simulated second)",
    "request_timeout": "is in simulated steps, which differ per replica; not supported in "
                       "cluster runs",
    "queue_timeout": "is in simulated steps, which differ per replica; not supported in "
                     "cluster runs",
    "per_request": "per-request records are not kept in cluster runs",
}


def _bad(option: str, message: str) -> LabOptionsError:
    return LabOptionsError(f"{option}: {message}", option)


@dataclass(frozen=True)
class ClusterPlan:
    lab: LabPlan                 # one mode; its settings are each replica's
    replicas: int
    router: str
    search: str | None
    search_p99_ttft_ms: float | None
    search_max_replicas: int
    options: dict[str, Any]      # as given (searches re-plan with a changed rate / size)

    @property
    def settings(self) -> SimSettings:
        return self.lab.settings[self.lab.modes[0]]


def plan_cluster(options: dict | None) -> ClusterPlan:
    """Validate cluster + lab options; LabOptionsError (naming the option) otherwise."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise LabOptionsError(f"options must be an object, got {type(options).__name__}")
    options = apply_preset(options)          # a preset is the lab's defaults, here too
    known = set(ClusterOptions.model_fields) | set(LabOptions.model_fields)
    unknown = sorted(set(options) - known)
    if unknown:
        raise LabOptionsError(
            f"unknown option(s) {', '.join(map(repr, unknown))}; cluster options: "
            f"{', '.join(ClusterOptions.model_fields)} (and the lab's: "
            f"{', '.join(LabOptions.model_fields)})", unknown[0])
    for name, why in _REFUSED.items():
        if options.get(name) not in (None, False):
            raise _bad(name, why)
    mine = {k: v for k, v in options.items() if k in ClusterOptions.model_fields
            and v is not None}
    try:
        c = ClusterOptions.model_validate(mine)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else None
        raise LabOptionsError(f"{name}: {_message(err)}", name) from None
    lab = {k: v for k, v in options.items() if k in LabOptions.model_fields}
    if isinstance(lab.get("cost_model"), str):
        # A shipped cost model by name (the page's picker); never a path (HTTP callers).
        name = lab["cost_model"]
        if name not in shipped_cost_models():
            raise _bad("cost_model", f"no shipped cost model named {name!r} (shipped: "
                       f"{', '.join(shipped_cost_models())}); or give the model's JSON object")
        lab["cost_model"] = shipped_cost_model(name)
    batching = lab.get("batching") or "continuous"
    if batching == "both":
        raise _bad("batching", "a cluster run simulates one mode: continuous or static")
    lab["batching"] = batching
    shared = None
    if c.prefix_groups or c.prefix_len:
        if not (c.prefix_groups and c.prefix_len):
            raise _bad("prefix_groups" if not c.prefix_groups else "prefix_len",
                       "a shared-prefix workload needs both prefix_groups and prefix_len > 0")
        shared = SharedPrefixSpec(c.prefix_groups, c.prefix_len, c.prefix_zipf)
        if lab.get("prompt_len") is None and lab.get("mix") in (None, "reference"):
            lab["prompt_len"] = list(DEFAULT_PREFIX_PROMPT)   # prefill is the point
    if c.search is not None and c.search_p99_ttft_ms is None:
        raise _bad("search_p99_ttft_ms", f"search {c.search!r} needs a p99 TTFT target")
    if c.search == "replicas" and lab.get("arrival_rate_s") is None:
        raise _bad("arrival_rate_s", "search 'replicas' needs the request rate to serve")
    plan = plan_lab(lab, shared_prefix=shared)
    return ClusterPlan(lab=plan, replicas=c.data_parallel_size, router=c.router,
                       search=c.search, search_p99_ttft_ms=c.search_p99_ttft_ms,
                       search_max_replicas=c.search_max_replicas, options=dict(options))


class _Replica:
    """One engine replica: a Scheduler, a SimExecutor and a clock in simulated seconds.

    `t` is when its next step starts. `step()` is the single lab's loop body (schedule,
    execute, update) and `add()` its arrival handling, idle skip included."""

    __slots__ = ("index", "sched", "execute", "executor", "t", "now", "now_s", "steps",
                 "busy_s", "slot_s", "busy_slot_steps", "computed", "stalled", "idle_s",
                 "num_requests", "tokens", "preemptions", "finished", "sink")

    def __init__(self, index: int, settings: SimSettings, cost: CostModel, sink):
        self.index = index
        self.now = 0.0
        self.now_s = 0.0
        self.sched = Scheduler(settings.scheduler, settings.cache, clock=lambda: self.now)
        if self.sched.slo is not None:
            self.sched.slo.use_clock(lambda: self.now_s)
        self.executor = SimExecutor(cost, settings.slots, settings.prefill_ignored)
        self.execute = self.executor.execute
        self.idle_s = cost.idle_step_s if cost.idle_step_s > 0 else 1e-3
        self.t = 0.0
        self.steps = 0
        self.busy_s = self.slot_s = 0.0
        self.busy_slot_steps = self.computed = self.stalled = 0
        self.num_requests = self.tokens = self.preemptions = 0
        self.sink = sink

    def add(self, req: Request, arrival_s: float) -> None:
        """Queue `req` arriving at `arrival_s` (QueueFullError passes through)."""
        sched = self.sched
        if arrival_s > self.t and not sched.requests:
            # Idle until the arrival: empty steps of idle_s, the last one ending at the
            # arrival itself, as simulate() skips them.
            gap = max(1, math.ceil((arrival_s - self.t) / self.idle_s))
            self.t = arrival_s
            self.steps += gap
            sched.skip_idle_steps(gap)
        self.now = self.t
        self.now_s = arrival_s
        try:
            sched.add_request(req)
        finally:
            self.now_s = self.t
        self.num_requests += 1

    def step(self) -> None:
        sched = self.sched
        self.now = self.t
        out = sched.schedule()
        if out.preempted_req_ids or out.swapped_out_req_ids:
            self.preemptions += len(out.preempted_req_ids) + len(out.swapped_out_req_ids)
            sink_pre = self.sink.preempted
            for rid in (*out.preempted_req_ids, *out.swapped_out_req_ids):
                sink_pre[sched.get_request(rid).user_data] += 1
        sampled = self.execute(out)
        nseq = len(out.num_scheduled_tokens)
        dt = self.executor.step_seconds
        end = self.t + dt
        if nseq:
            self.busy_s += dt
            self.slot_s += nseq * dt
            self.busy_slot_steps += nseq
            self.computed += self.executor.last_tokens
            self.stalled = 0
        else:
            self.stalled += 1
            if self.stalled > STALL_LIMIT and sched.requests:
                raise SimulationError(
                    f"replica {self.index}: the scheduler scheduled nothing for {STALL_LIMIT} "
                    f"steps while {sched.num_waiting} requests waited: the KV pool or the "
                    "token budget cannot fit the next request")
        self.now = self.now_s = end
        finished = sched.update_from_output(out, sampled)
        self.t = end
        self.steps += 1
        if finished:
            self.sink.finish(finished, end, self.index)
            for req in finished:
                self.tokens += req.num_output_tokens

    def load(self, ld: ReplicaLoad) -> None:
        sched = self.sched
        ld.num_running = len(sched.running)
        ld.num_waiting = sched.num_waiting
        ld.kv_usage = sched.block_manager.usage


class _Sink:
    """Per-request results by spec index, filled as requests finish."""

    def __init__(self, n: int, output_len: np.ndarray, itl: bool):
        self.first_token_s = np.zeros(n)
        self.finish_s = np.zeros(n)
        self.replica = np.full(n, -1, dtype=np.int32)
        self.preempted = np.zeros(n, dtype=np.int64)
        self.output_len = output_len
        self.itl = itl
        self.gaps: list[np.ndarray] = []

    def finish(self, reqs, end: float, replica: int) -> None:
        first, fin, rep, out_len = self.first_token_s, self.finish_s, self.replica, self.output_len
        for req in reqs:
            i = req.user_data
            if req.num_output_tokens != out_len[i]:
                raise SimulationError(
                    f"{req.request_id} finished with {req.num_output_tokens} tokens, "
                    f"expected {out_len[i]} (max_tokens, ignore_eos)")
            first[i] = req.first_token_time
            fin[i] = end
            rep[i] = replica
            if self.itl and req.num_output_tokens > 1:
                self.gaps.append(np.diff(np.asarray(req.token_times)))
            req.user_data = None


@dataclass
class ClusterResult:
    plan: ClusterPlan | None     # None: simulate_replicas on given specs
    settings: SimSettings
    specs: tuple[RequestSpec, ...]
    replicas: int
    router: str
    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    replica: np.ndarray          # -1: refused
    refused: np.ndarray
    queue_full: np.ndarray
    preemptions: np.ndarray
    itl_s: np.ndarray
    per_replica: list[dict[str, Any]]
    router_stats: dict[str, int]
    makespan_s: float
    cache_hits: int = 0
    cache_queries: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def simulate_cluster(plan: ClusterPlan, *, replicas: int | None = None,
                     router: str | None = None) -> ClusterResult:
    """Run the plan's workload over `replicas` (default the plan's) behind the Router."""
    lab = plan.lab
    groups = lab.prefix_groups
    prefix_len = lab.shared_prefix.prefix_len if lab.shared_prefix is not None else 0

    def prompt(k: int, spec: RequestSpec) -> list[int]:
        return prompt_token_ids(spec, groups[k] if groups is not None else -1, prefix_len)

    res = simulate_replicas(lab.specs, plan.settings, lab.cost,
                            replicas=plan.replicas if replicas is None else replicas,
                            router=plan.router if router is None else router,
                            seed=lab.workload.seed, prompt=prompt)
    res.plan = plan
    return res


def simulate_replicas(specs: Sequence[RequestSpec], settings: SimSettings, cost: CostModel,
                      *, replicas: int, router: str, seed: int = 0,
                      prompt: Callable[[int, RequestSpec], list[int]] | None = None
                      ) -> ClusterResult:
    """The cluster loop on given requests: `specs` in arrival order with `arrival_s` set
    (None: t = 0), indices 0..n-1; `prompt(k, spec)` gives the k-th request's token ids
    (default: distinct per request), which the router and the prefix cache see."""
    n_rep = replicas
    policy = router
    specs = tuple(specs)
    n = len(specs)
    if prompt is None:
        def prompt(k: int, spec: RequestSpec) -> list[int]:
            return prompt_token_ids(spec, -1, 0)
    by_index = np.zeros(n, dtype=np.int64)
    for s in specs:
        by_index[s.index] = s.output_len
    sink = _Sink(n, by_index, itl=not settings.prefill_ignored)
    reps = [_Replica(i, settings, cost, sink) for i in range(n_rep)]
    loads = [ReplicaLoad(f"replica-{i}", 0, 0, 0.0, settings.slots) for i in range(n_rep)]
    rt = Router(policy, block_size=settings.cache.block_size,
                cache_capacity_blocks=settings.cache.num_kv_blocks, seed=seed)
    arrival_s = np.zeros(n)
    refused = np.zeros(n, dtype=bool)
    queue_full = np.zeros(n, dtype=bool)
    heap: list[tuple[float, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    route = rt.route

    dirty: set[int] = set()        # replicas that stepped since the last routing

    for k, spec in enumerate(specs):
        t_a = spec.arrival_s if spec.arrival_s is not None else 0.0
        while heap and heap[0][0] < t_a:
            _, i = pop(heap)
            rep = reps[i]
            rep.step()
            if rep.sched.requests:
                push(heap, (rep.t, i))
            dirty.add(i)
        for i in dirty:                # each replica reports its load at the arrival
            reps[i].load(loads[i])
        dirty.clear()
        ids = prompt(k, spec)
        i = route(ids, loads)
        rep = reps[i]
        idle = not rep.sched.requests
        req = Request(f"req-{spec.index:06d}", ids,
                      SamplingParams(max_tokens=spec.output_len, ignore_eos=True,
                                     temperature=0.0),
                      priority=spec.priority, arrival_time=t_a, user_data=spec.index)
        arrival_s[spec.index] = t_a
        try:
            rep.add(req, t_a)
        except QueueFullError as e:        # policy slo or a full queue (429 / 503)
            refused[spec.index] = True
            if not isinstance(e, SLOUnattainableError):
                queue_full[spec.index] = True
        if idle and rep.sched.requests:
            push(heap, (rep.t, i))
        rep.load(loads[i])
    while heap:
        _, i = pop(heap)
        rep = reps[i]
        rep.step()
        if rep.sched.requests:
            push(heap, (rep.t, i))

    makespan = max((r.t for r in reps), default=0.0)
    per_replica = []
    hits = queries = 0
    for r in reps:
        bm = r.sched.block_manager
        hits += bm.num_cache_hits
        queries += bm.num_cache_queries
        per_replica.append({
            "replica": r.index, "requests": r.num_requests, "tokens": r.tokens,
            "steps": r.steps, "busy_s": r.busy_s,
            "busy_frac": r.busy_s / makespan if makespan > 0 else 0.0,
            "slot_utilization": (r.slot_s / (settings.slots * makespan)
                                 if makespan > 0 else 0.0),
            "computed_tokens": r.computed, "preemptions": r.preemptions,
            "prefix_cache_hit_rate": (bm.num_cache_hits / bm.num_cache_queries
                                      if bm.num_cache_queries else 0.0),
            "end_s": r.t,
        })
    itl = np.concatenate(sink.gaps) if sink.gaps else np.zeros(0)
    return ClusterResult(
        plan=None, settings=settings, specs=specs, replicas=n_rep, router=str(policy), arrival_s=arrival_s,
        first_token_s=sink.first_token_s, finish_s=sink.finish_s, replica=sink.replica,
        refused=refused, queue_full=queue_full, preemptions=sink.preempted, itl_s=itl,
        per_replica=per_replica,
        router_stats={"routed": rt.num_routed, "prefix_routed": rt.num_prefix_routed,
                      "fallbacks": rt.num_fallbacks},
        makespan_s=makespan, cache_hits=hits, cache_queries=queries)


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else 0.0


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else 0.0


def summarize_cluster(res: ClusterResult) -> dict[str, Any]:
    """The cluster report: JSON-ready, latencies in simulated seconds."""
    plan = res.plan
    settings = res.settings
    served = ~res.refused
    arrival = res.arrival_s[served]
    ttft = res.first_token_s[served] - arrival
    latency = res.finish_s[served] - arrival
    specs_out = np.zeros(len(res.arrival_s), dtype=np.int64)
    for s in res.specs:
        specs_out[s.index] = s.output_len
    tokens = int(specs_out[served].sum())
    time_s = res.makespan_s
    reqs = [r["requests"] for r in res.per_replica]
    mean_reqs = sum(reqs) / len(reqs) if reqs else 0.0
    out: dict[str, Any] = {
        "replicas": res.replicas,
        "router": res.router,
        "requests": int(len(res.arrival_s)),
        "served": int(served.sum()),
        "refused": int(res.refused.sum()),
        "refused_queue_full": int(res.queue_full.sum()),
        "tokens": tokens,
        "time_s": time_s,
        "throughput_tokens_per_s": tokens / time_s if time_s > 0 else 0.0,
        "requests_per_s": float(served.sum()) / time_s if time_s > 0 else 0.0,
        "mean_latency_s": _mean(latency), "p50_latency_s": _pct(latency, 50),
        "p99_latency_s": _pct(latency, 99),
        "preemptions": int(res.preemptions.sum()),
        "prefix_cache_hit_rate": res.cache_hits / res.cache_queries if res.cache_queries else 0.0,
        "load_imbalance": max(reqs) / mean_reqs if mean_reqs else 0.0,
        "router_stats": res.router_stats,
        "slots": settings.slots,
        "num_kv_blocks": settings.num_kv_blocks,
        "per_replica": res.per_replica,
    }
    if not settings.prefill_ignored:
        out.update(mean_ttft_s=_mean(ttft), p50_ttft_s=_pct(ttft, 50),
                   p90_ttft_s=_pct(ttft, 90), p99_ttft_s=_pct(ttft, 99),
                   mean_itl_s=_mean(res.itl_s), p50_itl_s=_pct(res.itl_s, 50),
                   p99_itl_s=_pct(res.itl_s, 99))
    st = settings.scheduler
    if st.slo_ttft_ms is not None or st.slo_tpot_ms is not None:
        ttft_all = res.first_token_s - res.arrival_s
        tpot = (res.finish_s - res.first_token_s) / np.maximum(specs_out - 1, 1)
        ok = served.copy()
        if st.slo_ttft_ms is not None:
            ok &= ttft_all <= st.slo_ttft_ms / 1000.0
        if st.slo_tpot_ms is not None:
            ok &= tpot <= st.slo_tpot_ms / 1000.0
        good = int(ok.sum())
        out.update(slo_ttft_ms=st.slo_ttft_ms, slo_tpot_ms=st.slo_tpot_ms, slo_met=good,
                   slo_attainment=good / len(ok) if len(ok) else 0.0,
                   goodput_rps=good / time_s if time_s > 0 else 0.0)
    if plan is None:
        return out
    wl = plan.lab.workload
    out["workload"] = {
        "seed": wl.seed, "arrival_rate_s": wl.arrival_rate_s,
        "prompt_len": list(wl.prompt_len) if wl.prompt_len else None,
        "prefix_groups": plan.lab.shared_prefix.groups if plan.lab.shared_prefix else 0,
        "prefix_len": plan.lab.shared_prefix.prefix_len if plan.lab.shared_prefix else 0,
        "cost_model": plan.lab.cost.description[:80],
    }
    return out


# --- searches ------------------------------------------------------------------------------
def _run(options: dict[str, Any]) -> dict[str, Any]:
    plan = plan_cluster({**options, "search": None, "search_p99_ttft_ms": None})
    return summarize_cluster(simulate_cluster(plan))


def _meets(summary: dict[str, Any], target_s: float) -> bool:
    """p99 TTFT of the served requests under the target, and nothing refused."""
    return summary["refused"] == 0 and summary.get("p99_ttft_s", summary["p99_latency_s"]) \
        <= target_s


def _row(summary: dict[str, Any], **extra: Any) -> dict[str, Any]:
    keys = ("replicas", "requests_per_s", "p50_ttft_s", "p99_ttft_s", "p99_itl_s",
            "throughput_tokens_per_s", "refused", "prefix_cache_hit_rate")
    return {**extra, **{k: summary[k] for k in keys if k in summary}}


def search_rate(options: dict[str, Any], p99_ttft_ms: float,
                iterations: int = SEARCH_ITERATIONS) -> dict[str, Any]:
    """The highest Poisson arrival rate (requests per simulated second) at which the p99
    TTFT stays at or under `p99_ttft_ms`, by bisection between 0 and the burst capacity
    (every request at t=0: requests / makespan) x 1.5, doubled while it still meets."""
    target = p99_ttft_ms / 1000.0
    burst = _run({**options, "arrival_rate_s": None})
    capacity = burst["requests_per_s"]
    runs: list[dict[str, Any]] = []

    def meets(rate: float) -> bool:
        s = _run({**options, "arrival_rate_s": rate})
        ok = _meets(s, target)
        runs.append(_row(s, arrival_rate_s=rate, meets=ok))
        return ok

    lo, bounded = highest_rate_meeting(meets, max(capacity * 1.5, 1e-6), iterations)
    if not bounded:
        return {"max_rate_rps": lo, "capacity_rps": capacity, "bounded": False,
                "p99_ttft_ms": p99_ttft_ms, "runs": runs}
    return {"max_rate_rps": lo if lo > 0 else None, "capacity_rps": capacity,
            "bounded": True, "p99_ttft_ms": p99_ttft_ms, "runs": runs}


def highest_rate_meeting(meets: Callable[[float], bool], start: float,
                         iterations: int) -> tuple[float, bool]:
    """The highest rate for which `meets` holds, assuming it holds below some rate and
    not above: `start` doubled (at most 4 times) while it still meets, then `iterations`
    bisection steps. Returns (that rate, or 0 if even the lowest probe failed; whether a
    failing rate bounded it: False when every doubling still met)."""
    lo, hi = 0.0, start
    for _ in range(4):                      # the first guess is too low: widen
        if not meets(hi):
            break
        lo, hi = hi, hi * 2
    else:
        return lo, False
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo, True


def search_replicas(options: dict[str, Any], p99_ttft_ms: float,
                    max_replicas: int = 64) -> dict[str, Any]:
    """The fewest replicas that serve `options`' arrival_rate_s at p99 TTFT <= target:
    doubling from 1, then bisection (p99 TTFT falls as replicas are added)."""
    target = p99_ttft_ms / 1000.0
    runs: list[dict[str, Any]] = []
    cache: dict[int, bool] = {}

    def meets(n: int) -> bool:
        if n not in cache:
            s = _run({**options, "data_parallel_size": n})
            cache[n] = _meets(s, target)
            runs.append(_row(s, meets=cache[n]))
        return cache[n]

    n = 1
    while not meets(n):
        if n >= max_replicas:
            return {"replicas": None, "max_replicas": max_replicas,
                    "p99_ttft_ms": p99_ttft_ms, "runs": runs}
        n = min(n * 2, max_replicas)
    lo, hi = n // 2, n                       # lo fails (or is 0), hi meets
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return {"replicas": hi, "max_replicas": max_replicas, "p99_ttft_ms": p99_ttft_ms,
            "runs": runs}


def run_cluster_lab(options: dict | None = None) -> dict[str, Any]:
    """Validate, simulate, summarise; with `search`, the search's answer under "search"."""
    plan = plan_cluster(options)
    out = summarize_cluster(simulate_cluster(plan))
    if plan.search is not None:
        base = {k: v for k, v in plan.options.items()
                if k not in ("search", "search_p99_ttft_ms", "search_max_replicas")}
        if plan.search == "rate":
            out["search"] = {"kind": "rate", **search_rate(base, plan.search_p99_ttft_ms)}
        else:
            out["search"] = {"kind": "replicas", **search_replicas(
                base, plan.search_p99_ttft_ms, plan.search_max_replicas)}
    return out


__all__ = ["ClusterOptions", "ClusterPlan", "ClusterResult", "plan_cluster",
           "simulate_cluster", "summarize_cluster", "search_rate", "search_replicas",
           "run_cluster_lab", "MAX_REPLICAS"]
