"""The lab's programmatic entry point, shared by `iterserve lab`, `POST /v1/lab/run` and /lab.

    run_lab({"batching": "both", "slots": 8, "requests": 48}) ->
        {"static": ModeResult, "continuous": ModeResult}

`options` keys are the CLI option names with '-' -> '_' (all optional); see OPTION_DEFAULTS
and docs/lab.md. Unknown keys and bad values raise LabOptionsError, whose message names the
option and what is wrong (fit for an HTTP 400 body or a CLI error line).

Defaults that depend on the workload, chosen so the reference case has no memory or budget
pressure (each slot can hold the longest request, every running request decodes each step):
- max_model_len = the longest prompt + output in the workload;
- max_num_batched_tokens = slots + max_model_len with prefill ignored (all decodes plus one
  whole recompute), 2048 with prefill on (at least max_model_len without chunked prefill);
- num_kv_blocks = slots x ceil(max_model_len / block_size); the swap pool, with
  preemption_mode "swap", is as large as the device pool;
- priority_frac = 0.2 under the priority policy (a minority urgent class), else 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from iterserve.core.config import (
    CacheConfig, ConfigError, SchedulerConfig, check_knob, knob_fields)
from iterserve.lab.cost_model import CostModel, CostModelError, default_cost_model
from iterserve.lab.metrics import summarize
from iterserve.lab.simulator import SimResult, SimSettings, simulate
from iterserve.lab.workload import (
    MAX_LENGTH, RequestSpec, WorkloadError, WorkloadSpec, check_lengths, check_range,
    draw_workload)

# The seed of the reference case: its draw lands near the mission's figures
# (static ~2,100 steps at ~35%, continuous ~950 at ~78%).
DEFAULT_SEED = 9288
MAX_SLOTS = 4096
MAX_REQUESTS = 1_000_000
MAX_ARRIVAL_SPAN = 10_000_000   # steps the arrivals may spread over (one float of memory each)
DEFAULT_PRIORITY_FRAC = 0.2

OPTION_DEFAULTS: dict[str, Any] = {
    "batching": "both", "slots": 8, "requests": 48, "seed": DEFAULT_SEED,
    "short_frac": 0.8, "short": [10, 100], "long": [250, 500], "lengths": None,
    "arrival_rate": None, "prompt_len": None, "max_num_batched_tokens": None,
    "chunked_prefill": True, "num_kv_blocks": None, "block_size": 16,
    "preemption_mode": "recompute", "policy": "fcfs", "priority_frac": None,
    "cost_model": None, "per_request": False,
    # Scheduler knobs checked by the one schema (core/config.py), under their engine names.
    "enable_prefix_caching": False, "long_prefill_token_threshold": 0,
    "max_num_partial_prefills": 1,
    "mix": "reference",
    # SLO experiments (issue 18): Poisson arrivals per simulated second, and the targets
    # (schema knobs; goodput is reported whenever one is set, policy "slo" admits by them).
    "arrival_rate_s": None, "slo_ttft_ms": None, "slo_tpot_ms": None,
}
# Workload mixes: "reference" draws prompt_len (if given) uniformly; "longprompt" makes
# LONGPROMPT_FRAC of the prompts long (LONGPROMPT_LEN tokens) among short chats (prompt_len,
# default 20-100), the case chunked prefill and the long-prefill threshold are for.
MIXES = ("reference", "longprompt")
LONGPROMPT_FRAC = 0.1
LONGPROMPT_LEN = (1500, 2000)
LONGPROMPT_SHORT = (20, 100)
_SCHEMA_OPTIONS = ("enable_prefix_caching", "long_prefill_token_threshold",
                   "max_num_partial_prefills", "slo_ttft_ms", "slo_tpot_ms")
MODES = ("static", "continuous")


class LabOptionsError(ValueError):
    """A lab option with a bad value (or an unknown option); the message names it."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class LabPlan:
    """Validated options: what to draw, how to schedule it, how to time it."""

    modes: tuple[str, ...]
    workload: WorkloadSpec
    specs: tuple[RequestSpec, ...]
    settings: dict[str, SimSettings]
    cost: CostModel
    per_request: bool


def _bad(option: str, message: str) -> LabOptionsError:
    return LabOptionsError(f"{option}: {message}", option)


def _int(opts: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = opts[name]
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"expected an integer, got {v!r}")
    if v < lo:
        raise _bad(name, f"must be at least {lo}, got {v}")
    if hi is not None and v > hi:
        raise _bad(name, f"must be at most {hi}, got {v}")
    return v


def _float(opts: dict, name: str, lo: float, hi: float | None = None, *,
           lo_open: bool = False) -> float | None:
    v = opts[name]
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, f"expected a finite number, got {v!r}")
    if v < lo or (lo_open and v == lo):
        raise _bad(name, f"must be {'greater than' if lo_open else 'at least'} {lo}, got {v}")
    if hi is not None and v > hi:
        raise _bad(name, f"must be at most {hi}, got {v}")
    return float(v)


def _choice(opts: dict, name: str, choices: tuple[str, ...]) -> str:
    v = opts[name]
    if v not in choices:
        raise _bad(name, f"must be one of {', '.join(choices)}; got {v!r}")
    return v


def _bool(opts: dict, name: str) -> bool:
    v = opts[name]
    if not isinstance(v, bool):
        raise _bad(name, f"expected true or false, got {v!r}")
    return v


def _range(opts: dict, name: str) -> tuple[int, int] | None:
    v = opts[name]
    if v is None:
        return None
    try:
        return check_range(list(v) if isinstance(v, tuple) else v, name)
    except WorkloadError as e:
        raise LabOptionsError(str(e), name) from e


_KNOBS = {name: k for cls in (SchedulerConfig, CacheConfig) for name, _, k in knob_fields(cls)}


def _schema_knob(opts: dict, name: str) -> Any:
    """A scheduler knob checked by its definition in core/config.py (one message for the
    engine, the lab and its CLI)."""
    try:
        return check_knob(name, opts[name], _KNOBS[name])
    except ConfigError as e:
        raise _bad(name, str(e).removeprefix(f"{name} ")) from e


def plan_lab(options: dict | None) -> LabPlan:
    """Validate `options` and resolve the workload-dependent defaults."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise LabOptionsError(f"options must be an object, got {type(options).__name__}")
    unknown = sorted(set(options) - set(OPTION_DEFAULTS))
    if unknown:
        raise LabOptionsError(
            f"unknown option(s) {', '.join(map(repr, unknown))}; known options: "
            f"{', '.join(OPTION_DEFAULTS)}", unknown[0])
    opts = {**OPTION_DEFAULTS, **{k: v for k, v in options.items() if v is not None}}

    batching = _choice(opts, "batching", ("static", "continuous", "both"))
    modes = MODES if batching == "both" else (batching,)
    slots = _int(opts, "slots", 1, MAX_SLOTS)
    seed = _int(opts, "seed", 0)
    short_frac = _float(opts, "short_frac", 0.0, 1.0)
    short = _range(opts, "short")
    long_ = _range(opts, "long")
    lengths = opts["lengths"]
    if lengths is not None:
        try:
            lengths = check_lengths(lengths)
        except WorkloadError as e:
            raise LabOptionsError(str(e), "lengths") from e
        if "requests" in options and options["requests"] is not None:
            requests = _int(opts, "requests", 1, MAX_REQUESTS)
            if requests != len(lengths):
                raise _bad("requests", f"{requests} requests but {len(lengths)} lengths given; "
                           "leave requests out when giving lengths")
        requests = len(lengths)
        if requests > MAX_REQUESTS:
            raise _bad("lengths", f"at most {MAX_REQUESTS} lengths, got {requests}")
    else:
        requests = _int(opts, "requests", 1, MAX_REQUESTS)
    arrival_rate = _float(opts, "arrival_rate", 0.0, lo_open=True)
    if arrival_rate is not None and requests / arrival_rate > MAX_ARRIVAL_SPAN:
        raise _bad("arrival_rate",
                   f"{requests} requests at {arrival_rate:g} per step would arrive over "
                   f"~{requests / arrival_rate:,.0f} steps; the lab simulates at most "
                   f"{MAX_ARRIVAL_SPAN:,} (raise the rate or lower the requests)")
    prompt_len = _range(opts, "prompt_len")
    mix = _choice(opts, "mix", MIXES)
    long_prompt_frac, long_prompt = 0.0, None
    if mix == "longprompt":
        prompt_len = prompt_len or LONGPROMPT_SHORT
        long_prompt_frac, long_prompt = LONGPROMPT_FRAC, LONGPROMPT_LEN
    knobs = {name: _schema_knob(opts, name) for name in _SCHEMA_OPTIONS}
    chunked = _bool(opts, "chunked_prefill")
    block_size = _int(opts, "block_size", 1, 4096)
    preemption_mode = _choice(opts, "preemption_mode", ("recompute", "swap"))
    policy = _choice(opts, "policy", ("fcfs", "priority", "slo"))
    arrival_rate_s = _float(opts, "arrival_rate_s", 0.0, lo_open=True)
    if arrival_rate_s is not None and arrival_rate is not None:
        raise _bad("arrival_rate_s", "give arrival_rate (per step) or arrival_rate_s (per "
                   "simulated second), not both")
    if arrival_rate_s is not None and requests / arrival_rate_s > MAX_ARRIVAL_SPAN:
        raise _bad("arrival_rate_s", f"{requests} requests at {arrival_rate_s:g} per second "
                   f"would arrive over more than {MAX_ARRIVAL_SPAN:,} seconds")
    priority_frac = _float(opts, "priority_frac", 0.0, 1.0)
    if priority_frac is None:
        priority_frac = DEFAULT_PRIORITY_FRAC if policy == "priority" else 0.0
    per_request = _bool(opts, "per_request")

    cost_opt = opts["cost_model"]
    if cost_opt is None:
        cost = default_cost_model()
    elif isinstance(cost_opt, CostModel):
        cost = cost_opt
    else:
        try:
            cost = CostModel.from_dict(cost_opt)
        except CostModelError as e:
            raise _bad("cost_model", str(e)) from e

    workload = WorkloadSpec(
        requests=requests, seed=seed, short_frac=short_frac, short=short, long=long_,
        lengths=lengths, arrival_rate=arrival_rate, prompt_len=prompt_len,
        priority_frac=priority_frac, long_prompt_frac=long_prompt_frac, long_prompt=long_prompt,
        arrival_rate_s=arrival_rate_s)
    specs = tuple(sorted(draw_workload(workload), key=lambda s: (s.arrival, s.index)))

    max_model_len = max(2, max(s.prompt_len + s.output_len for s in specs))
    prefill_ignored = prompt_len is None
    budget = _int(opts, "max_num_batched_tokens", 1, 10 * MAX_LENGTH)
    if budget is None:
        budget = slots + max_model_len if prefill_ignored else 2048
        if not chunked:
            budget = max(budget, max_model_len)
    elif not chunked and budget < max_model_len:
        raise _bad("max_num_batched_tokens",
                   f"{budget} is below the longest request ({max_model_len} tokens): without "
                   "chunked prefill it could never be scheduled; raise it or turn chunked "
                   "prefill on")
    blocks_per_request = -(-max_model_len // block_size)
    num_kv_blocks = _int(opts, "num_kv_blocks", 1, 100_000_000)
    if num_kv_blocks is None:
        num_kv_blocks = slots * blocks_per_request
    elif num_kv_blocks < blocks_per_request:
        raise _bad("num_kv_blocks",
                   f"{num_kv_blocks} blocks of {block_size} tokens cannot hold the longest "
                   f"request ({max_model_len} tokens needs {blocks_per_request} blocks)")

    settings = {}
    for mode in modes:
        try:
            sc = SchedulerConfig(
                max_num_seqs=slots, max_num_batched_tokens=budget, max_model_len=max_model_len,
                enable_chunked_prefill=chunked, scheduling_policy=policy, batching=mode,
                preemption_mode=preemption_mode,
                long_prefill_token_threshold=knobs["long_prefill_token_threshold"],
                max_num_partial_prefills=knobs["max_num_partial_prefills"],
                slo_ttft_ms=knobs["slo_ttft_ms"], slo_tpot_ms=knobs["slo_tpot_ms"]).validate()
            cc = CacheConfig(
                block_size=block_size, num_kv_blocks=num_kv_blocks,
                # Swap needs a host pool; as large as the device pool, so swap never fails
                # for room.
                num_swap_blocks=num_kv_blocks if preemption_mode == "swap" else 0,
                enable_prefix_caching=knobs["enable_prefix_caching"]).validate()
        except ConfigError as e:
            raise LabOptionsError(str(e), e.knob) from e
        settings[mode] = SimSettings(sc, cc, prefill_ignored)
    return LabPlan(modes=modes, workload=workload, specs=specs, settings=settings, cost=cost,
                   per_request=per_request)


def simulate_plan(plan: LabPlan, *, record: bool = False) -> dict[str, SimResult]:
    """Run every mode of the plan; `record` keeps what traces, plots and per-request need."""
    record = record or plan.per_request
    gaps = plan.workload.prompt_len is not None
    return {mode: simulate(list(plan.specs), plan.settings[mode], plan.cost, record=record,
                           token_gaps=gaps)
            for mode in plan.modes}


def run_lab(options: dict | None = None) -> dict[str, Any]:
    """Validate, simulate and summarise: {"static": ModeResult, "continuous": ModeResult}."""
    plan = plan_lab(options)
    results = simulate_plan(plan)
    return {mode: summarize(res, per_request=plan.per_request) for mode, res in results.items()}
