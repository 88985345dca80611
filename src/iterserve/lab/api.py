"""The lab's programmatic entry point, shared by `iterserve lab`, `POST /v1/lab/run` and /lab.

    run_lab({"batching": "both", "max_num_seqs": 8, "requests": 48}) ->
        {"static": ModeResult, "continuous": ModeResult}

`options` keys are the CLI option names with '-' -> '_' (all optional): the fields of the
pydantic model `LabOptions` (lab/options.py), whose scheduler fields come from the knob
schema in core/config.py. Unknown keys and bad values raise LabOptionsError, whose message
names the option and what is wrong (fit for an HTTP 400 body or a CLI error line).

Defaults that depend on the workload, chosen so the reference case has no memory or budget
pressure (each slot can hold the longest request, every running request decodes each step):
- max_model_len = the longest prompt + output in the workload;
- max_num_batched_tokens = max_num_seqs + max_model_len with prefill ignored (all decodes plus one
  whole recompute), 2048 with prefill on (at least max_model_len without chunked prefill);
- num_kv_blocks = max_num_seqs x ceil(max_model_len / block_size); the swap pool, with
  preemption_mode "swap", is as large as the device pool;
- priority_frac = 0.2 under the priority policy (a minority urgent class), else 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.cost_model import CostModel, default_cost_model
from iterserve.core.spec_decode import SpeculativeConfig, SpeculativeConfigError
from iterserve.errors import ConfigError, CostModelError, LabOptionsError, WorkloadError
from iterserve.lab.metrics import summarize
from iterserve.lab.options import (  # noqa: F401  (re-exported for callers)
    MAX_REQUESTS, MAX_SLOTS, OPTION_DEFAULTS, LabOptions, parse_options)
from iterserve.lab.simulator import SimResult, SimSettings, simulate
from iterserve.lab.workload import (RequestSpec, SharedPrefixSpec, WorkloadSpec, check_lengths,
                                    check_range, draw_workload, with_shared_prefix)

# The seed of the reference case: its draw lands near the mission's figures
# (static ~2,100 steps at ~35%, continuous ~950 at ~78%).
DEFAULT_SEED = 9288
MAX_ARRIVAL_SPAN = 10_000_000   # steps the arrivals may spread over (one float of memory each)
DEFAULT_PRIORITY_FRAC = 0.2
MODES = ("static", "continuous")
# Workload mixes: "reference" draws prompt_len (if given) uniformly; "longprompt" makes
# LONGPROMPT_FRAC of the prompts long (LONGPROMPT_LEN tokens) among short chats (prompt_len,
# default 20-100), the case chunked prefill and the long-prefill threshold are for.
LONGPROMPT_FRAC = 0.1
LONGPROMPT_LEN = (1500, 2000)
LONGPROMPT_SHORT = (20, 100)


@dataclass(frozen=True)
class LabPlan:
    """Validated options: what to draw, how to schedule it, how to time it."""

    modes: tuple[str, ...]
    workload: WorkloadSpec
    specs: tuple[RequestSpec, ...]
    settings: dict[str, SimSettings]
    cost: CostModel
    per_request: bool
    # Shared-prefix workloads (the cluster lab): each request's prefix group (by index) and
    # the prefix length already counted in its prompt_len; None without one.
    prefix_groups: tuple[int, ...] | None = None
    shared_prefix: SharedPrefixSpec | None = None


def _bad(option: str, message: str) -> LabOptionsError:
    return LabOptionsError(f"{option}: {message}", option)


def _range(value: Any, name: str) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        return check_range(list(value) if isinstance(value, tuple) else value, name)
    except WorkloadError as e:
        raise LabOptionsError(str(e), name) from e


def plan_lab(options: dict | None, *, shared_prefix: SharedPrefixSpec | None = None
             ) -> LabPlan:
    """Validate `options` (the LabOptions model, lab/options.py) and resolve the
    workload-dependent defaults and the rules that need the drawn workload.

    `shared_prefix` (the cluster lab, lab/cluster.py) puts one of a few shared prefixes in
    front of every prompt before the defaults are derived, so max_model_len and the KV
    pool are sized for the longer prompts."""
    o = parse_options(options)
    given = options or {}
    modes = MODES if o.batching == "both" else (o.batching,)
    slots = o.max_num_seqs
    seed = DEFAULT_SEED if o.seed is None else o.seed
    short = _range(o.short, "short")
    long_ = _range(o.long, "long")
    lengths = o.lengths
    requests = o.requests
    if lengths is not None:
        try:
            lengths = check_lengths(lengths)
        except WorkloadError as e:
            raise LabOptionsError(str(e), "lengths") from e
        if given.get("requests") is not None and requests != len(lengths):
            raise _bad("requests", f"{requests} requests but {len(lengths)} lengths given; "
                       "leave requests out when giving lengths")
        requests = len(lengths)
        if requests > MAX_REQUESTS:
            raise _bad("lengths", f"at most {MAX_REQUESTS} lengths, got {requests}")
    arrival_rate = o.arrival_rate
    if arrival_rate is not None and requests / arrival_rate > MAX_ARRIVAL_SPAN:
        raise _bad("arrival_rate",
                   f"{requests} requests at {arrival_rate:g} per step would arrive over "
                   f"~{requests / arrival_rate:,.0f} steps; the lab simulates at most "
                   f"{MAX_ARRIVAL_SPAN:,} (raise the rate or lower the requests)")
    arrival_rate_s = o.arrival_rate_s
    if arrival_rate_s is not None and arrival_rate is not None:
        raise _bad("arrival_rate_s", "give arrival_rate (per step) or arrival_rate_s (per "
                   "simulated second), not both")
    if arrival_rate_s is not None and requests / arrival_rate_s > MAX_ARRIVAL_SPAN:
        raise _bad("arrival_rate_s", f"{requests} requests at {arrival_rate_s:g} per second "
                   f"would arrive over more than {MAX_ARRIVAL_SPAN:,} seconds")
    if arrival_rate_s is not None:
        for name in ("request_timeout", "queue_timeout"):
            if getattr(o, name) is not None:
                raise _bad(name, "is in simulated steps; use it with arrival_rate (per "
                           "step), not arrival_rate_s")
    prompt_len = _range(o.prompt_len, "prompt_len")
    long_prompt_frac, long_prompt = 0.0, None
    if o.mix == "longprompt":
        prompt_len = prompt_len or LONGPROMPT_SHORT
        long_prompt_frac = LONGPROMPT_FRAC if o.long_prompt_frac is None else o.long_prompt_frac
        long_prompt = LONGPROMPT_LEN
    elif o.long_prompt_frac is not None:
        raise _bad("long_prompt_frac", "needs mix longprompt")
    chunked = o.enable_chunked_prefill
    block_size = o.block_size
    policy = o.scheduling_policy
    priority_frac = o.priority_frac
    if priority_frac is None:
        priority_frac = DEFAULT_PRIORITY_FRAC if policy == "priority" else 0.0

    cost_opt = o.cost_model
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
        requests=requests, seed=seed, short_frac=o.short_frac, short=short, long=long_,
        lengths=lengths, arrival_rate=arrival_rate, prompt_len=prompt_len,
        priority_frac=priority_frac, long_prompt_frac=long_prompt_frac, long_prompt=long_prompt,
        arrival_rate_s=arrival_rate_s)
    specs = tuple(sorted(draw_workload(workload), key=lambda s: (s.arrival, s.index)))
    prefix_groups = None
    if shared_prefix is not None:
        shifted, groups = with_shared_prefix(list(specs), shared_prefix, seed)
        specs, prefix_groups = tuple(shifted), tuple(groups)

    max_model_len = max(2, max(s.prompt_len + s.output_len for s in specs))
    prefill_ignored = prompt_len is None
    # Not given: every running request decodes each step plus one whole recompute (prefill
    # ignored), else 2048; SchedulerConfig.validate raises it to max_model_len without
    # chunked prefill and rejects an explicit budget below that (the engine's one rule).
    default_budget = slots + max_model_len if prefill_ignored else 2048
    blocks_per_request = -(-max_model_len // block_size)
    num_kv_blocks = o.num_kv_blocks
    if num_kv_blocks is None:
        num_kv_blocks = slots * blocks_per_request
    elif num_kv_blocks < blocks_per_request:
        raise _bad("num_kv_blocks",
                   f"{num_kv_blocks} blocks of {block_size} tokens cannot hold the longest "
                   f"request ({max_model_len} tokens needs {blocks_per_request} blocks)")

    speculative = _lab_speculation(o.speculative_config, o.spec_acceptance)
    settings = {}
    for mode in modes:
        try:
            sc = SchedulerConfig(
                max_num_seqs=slots, max_num_batched_tokens=o.max_num_batched_tokens,
                max_model_len=max_model_len, enable_chunked_prefill=chunked,
                scheduling_policy=policy, batching=mode, preemption_mode=o.preemption_mode,
                long_prefill_token_threshold=o.long_prefill_token_threshold,
                max_num_partial_prefills=o.max_num_partial_prefills,
                max_long_partial_prefills=o.max_long_partial_prefills,
                max_long_prefill_tokens=o.max_long_prefill_tokens,
                priority_less_urgent_tokens=o.priority_less_urgent_tokens,
                priority_guard_steps=o.priority_guard_steps,
                slo_ttft_ms=o.slo_ttft_ms, slo_tpot_ms=o.slo_tpot_ms,
                max_queued_requests=o.max_queued_requests,
                request_timeout=o.request_timeout, queue_timeout=o.queue_timeout,
                speculative_config=speculative,
            ).validate(default_max_num_batched_tokens=default_budget)
            cc = CacheConfig(
                block_size=block_size, num_kv_blocks=num_kv_blocks,
                # Swap needs a host pool; as large as the device pool, so swap never fails
                # for room.
                num_swap_blocks=num_kv_blocks if o.preemption_mode == "swap" else 0,
                enable_prefix_caching=o.enable_prefix_caching).validate()
        except ConfigError as e:
            raise LabOptionsError(str(e), e.knob) from e
        settings[mode] = SimSettings(sc, cc, prefill_ignored)
    return LabPlan(modes=modes, workload=workload, specs=specs, settings=settings, cost=cost,
                   per_request=o.per_request, prefix_groups=prefix_groups,
                   shared_prefix=shared_prefix)


def _lab_speculation(config: Any, acceptance: Any) -> dict | None:
    """The engine's `speculative_config` as the lab runs it: `synthetic` with the workload's
    per-position acceptance. The lab's prompts are one repeated token, so what an n-gram or
    suffix proposer would find in them says nothing about a real workload; its acceptance
    is given instead (`spec_acceptance`, or a synthetic config's own `acceptance_rates`)
    and every step proposes num_speculative_tokens drafts. The plan of how many of them to
    verify, their token budget and KV blocks, and the online refit of the step time are the
    engine's own (core/spec_decode), on the lab's seconds."""
    if config is None:
        if acceptance is not None:
            raise _bad("spec_acceptance", "needs speculative_config")
        return None
    try:
        spec = SpeculativeConfig.parse(config)
    except SpeculativeConfigError as e:
        where = f".{e.key}" if e.key else ""
        raise _bad(f"speculative_config{where}", str(e)) from None
    if spec is None:
        return None
    if spec.method == "draft_model":
        raise _bad("speculative_config.method", "draft_model is not simulated (the draft "
                   "model's own steps have no cost model); use synthetic, ngram or suffix "
                   "with the draft's acceptance as spec_acceptance")
    if spec.method == "synthetic":
        if acceptance is not None:
            raise _bad("spec_acceptance", "synthetic carries its own acceptance_rates")
        return spec.to_dict()
    if acceptance is None:
        raise _bad("spec_acceptance", f"method {spec.method} needs the workload's "
                   "per-position acceptance in the lab, e.g. [0.8, 0.64, 0.51, 0.41]")
    if isinstance(acceptance, (int, float)) and not isinstance(acceptance, bool):
        # One number a: each draft accepted with a given the one before it was.
        acceptance = [float(acceptance) ** (j + 1) for j in range(spec.num_speculative_tokens)]
    if not isinstance(acceptance, (list, tuple)):
        raise _bad("spec_acceptance", f"must be a list of probabilities or one number, got "
                   f"{acceptance!r}")
    d = {"method": "synthetic", "num_speculative_tokens": spec.num_speculative_tokens,
         "acceptance_rates": list(acceptance), "adaptive": spec.adaptive}
    if spec.cost_model is not None:
        d["cost_model"] = spec.cost_model
    try:
        SpeculativeConfig.parse(d)
    except SpeculativeConfigError as e:
        raise _bad("spec_acceptance", str(e).replace("acceptance_rates", "spec_acceptance")
                   .replace("num_speculative_tokens", "speculative_config."
                            "num_speculative_tokens")) from None
    return d


def simulate_plan(plan: LabPlan, *, record: bool = False) -> dict[str, SimResult]:
    """Run every mode of the plan; `record` keeps what traces, plots and per-request need."""
    record = record or plan.per_request
    gaps = plan.workload.prompt_len is not None
    return {mode: simulate(list(plan.specs), plan.settings[mode], plan.cost, record=record,
                           token_gaps=gaps, seed=plan.workload.seed)
            for mode in plan.modes}


def run_lab(options: dict | None = None) -> dict[str, Any]:
    """Validate, simulate and summarise: {"static": ModeResult, "continuous": ModeResult}."""
    plan = plan_lab(options)
    results = simulate_plan(plan)
    return {mode: summarize(res, per_request=plan.per_request) for mode, res in results.items()}
