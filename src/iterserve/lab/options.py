"""The lab's options as one pydantic model, its scheduler fields made from the knob schema.

`LabOptions` is what `run_lab`, `iterserve lab` and `POST /v1/lab/run` accept. The
scheduler and KV-cache fields (`SHARED_KNOBS`) are generated from `core/config.py` (type,
bounds, choices, help, default), so the lab checks a knob exactly as the engine does and
starts from the engine's default, except where `LAB_DEFAULTS` says why not; the workload
fields (what to draw, how to time it) are the lab's own. Validation is strict (no "8" for 8,
no 1 for true) and every error is turned into a `LabOptionsError` whose message names the
option.

Every engine knob carries the engine's own name. The lab's former spellings (`RENAMED`:
slots, policy, chunked_prefill) are refused with a message naming the new one, so an old
script fails loudly instead of silently running the defaults.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, ValidationError, create_model

from iterserve.core.config import CacheConfig, Knob, SchedulerConfig, default_on, knobs_of
from iterserve.core.cost_model import load_cost_model
from iterserve.errors import LabOptionsError
from iterserve.lab import preset_scale

MAX_SLOTS = 4096
MAX_REQUESTS = 1_000_000
MAX_LENGTH = 100_000

# Former lab option name -> its engine name; refused with a pointer to the new name.
RENAMED = {"slots": "max_num_seqs", "policy": "scheduling_policy",
           "chunked_prefill": "enable_chunked_prefill"}
# The engine knobs the lab takes, under the engine's names, with the engine's defaults
# (its CPU ones: the shipped cost models are CPU fits) unless LAB_DEFAULTS says otherwise.
SHARED_KNOBS: tuple[str, ...] = (
    "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
    "long_prefill_token_threshold", "max_num_partial_prefills", "max_long_partial_prefills",
    "max_long_prefill_tokens", "priority_less_urgent_tokens", "priority_guard_steps",
    "scheduling_policy", "batching", "preemption_mode", "num_kv_blocks", "block_size",
    "enable_prefix_caching", "max_queued_requests", "request_timeout", "queue_timeout",
    "slo_ttft_ms", "slo_tpot_ms")
# The one place where a lab default differs from the engine's, and why.
LAB_DEFAULTS: dict[str, tuple[Any, str]] = {
    "max_num_seqs": (8, "the reference case (README): 48 requests on 8 slots, few enough to "
                        "read the slot chart, enough for static batching's idle slots to show"),
    "batching": ("both", "the lab's question is static against continuous: 'both' runs the "
                         "same workload each way, side by side"),
    "max_num_batched_tokens": (None, "derived from the workload (lab/api.py) rather than the "
                                     "engine's per-device default: every running request's "
                                     "decode plus one whole recompute with prefill ignored, "
                                     "else 2048, so the reference case has no budget pressure"),
    "num_kv_blocks": (None, "derived from the workload (lab/api.py): every slot can hold the "
                            "longest request, where the engine sizes it from a memory budget"),
    "enable_prefix_caching": (False, "the lab's questions are scheduling trade-offs, and its "
                                     "simulated prompts are one repeated token (simulator.py), "
                                     "so a prefix cache would serve every prompt from the last "
                                     "one and hide the prefill cost they are about (the cluster "
                                     "lab's shared-prefix workloads turn it on)"),
}
# An option's values in the lab where they are more than the knob's choices (a superset).
LAB_CHOICES: dict[str, tuple[str, ...]] = {"batching": ("static", "continuous", "both")}
# Lab-only upper bounds that keep a run interactive.
LAB_MAXIMA: dict[str, float] = {
    "max_num_seqs": MAX_SLOTS, "max_num_batched_tokens": 10 * MAX_LENGTH,
    "num_kv_blocks": 100_000_000, "block_size": 4096,
    "max_queued_requests": MAX_REQUESTS,   # a full queue refuses the arrival
}

# What the two document-QA presets share (they differ in the long share, rate and budget).
_LONGPROMPT_BASE: dict[str, Any] = {"batching": "continuous", "max_num_seqs": 16,
                                    "mix": "longprompt", "enable_chunked_prefill": True,
                                    "cost_model": "smollm2-cpu"}

# Presets (the scheduling trade-offs, and the SLO overload case): named option sets a user picks
# on the page (GET /v1/lab/presets fills the form) or with `iterserve lab --preset NAME`.
# A preset's options are defaults: options given with it override them. Each says which one
# knob to flip to see the trade-off; benchmarks/slo_tradeoffs.py runs the full sweeps and
# BENCHMARKS.md has the table. All use the shipped cost model fitted to the bundled model
# on the reference CPU (`smollm2-cpu`), so the simulated seconds are that machine's.
PRESETS: dict[str, dict[str, Any]] = {
    "slo-overload": {
        "description": "Poisson arrivals at ~1.5x capacity ({arrival_rate_s:g} requests/s, 64 "
                       "slots) with TTFT <= {slo_ttft_ms:g} ms and TPOT <= {slo_tpot_ms:g} ms: "
                       "policy slo keeps goodput up by refusing "
                       "what cannot start in time; switch the policy to fcfs and every "
                       "request is late.",
        "options": {"batching": "continuous", "max_num_seqs": 64, "requests": 300,
                    "prompt_len": [8, 40], "arrival_rate_s": 3.0,
                    "scheduling_policy": "slo", "slo_ttft_ms": 1000.0, "slo_tpot_ms": 100.0,
                    "cost_model": "smollm2-cpu"},
    },
    "longprompt": {
        "description": "Document-QA / RAG traffic: 30% of the prompts carry 1500-2000 tokens of "
                       "context, the rest are short chats (20-100 tokens), Poisson arrivals "
                       "at ~0.7x capacity. Chunked prefill with a 128-token budget keeps "
                       "every inter-token gap to one small chunk; untick chunked prefill and "
                       "each long prompt stalls every running decode for its whole prefill "
                       "(seconds: p99 inter-token latency ~10x worse), for ~2% more "
                       "throughput and a shorter TTFT for the long prompts.",
        "options": {**_LONGPROMPT_BASE, "requests": 200, "long_prompt_frac": 0.3,
                    "arrival_rate_s": 0.35, "max_num_batched_tokens": 128},
    },
    # The traffic chunked prefill exists for, at this engine's speed. With chunking off a
    # long prompt stalls every running decode for its whole prefill, but p99 ITL sees that
    # only when the stalls are >= 1% of all inter-token gaps. That share is about long-prompt
    # arrivals per second x the time per output token (Little's law), and the time per
    # output token is short on this engine below capacity (its step time is mostly per
    # sequence, so batching does not slow it much), so the share stays near 1% for
    # `longprompt` (30% long at ~0.85x capacity): p99 sees the stall in some draws and not
    # in others. Here 70% of the prompts are long at the same load factor: the stalls are
    # 1.2-7% of the gaps over seeds 100-109 (benchmarks/slo_tradeoffs.py), so p99 is the
    # stall with chunking off and one chunk step with it on. Longer prompts (4k+) would make
    # the share smaller, not larger: fewer of them fit in the same prefill time.
    "longprompt-heavy": {
        "description": "Stall-heavy document QA: 70% of the prompts carry 1500-2000 tokens "
                       "of context among short chats, Poisson at ~0.85x capacity "
                       "({arrival_rate_s:g} requests/s, 16 slots). Chunking off, each long "
                       "prompt stalls the running decodes for its whole prefill, often "
                       "enough (>= 1% of the gaps) to be the p99 inter-token latency; a "
                       "64-token budget caps every gap at one small chunk step.",
        "options": {**_LONGPROMPT_BASE, "requests": 64, "long_prompt_frac": 0.7,
                    "arrival_rate_s": 0.248, "max_num_batched_tokens": 64,
                    "num_kv_blocks": 2048},
    },
    "priority-flood": {
        "description": "An interactive class (10%, priority 0) while a batch class floods "
                       "the server at ~1.5x capacity: under policy priority the interactive "
                       "TTFT stays near its value alone; switch to fcfs and it waits behind "
                       "the flood.",
        "options": {"batching": "continuous", "max_num_seqs": 16, "requests": 300,
                    "prompt_len": [8, 40], "arrival_rate_s": 3.0,
                    "scheduling_policy": "priority", "priority_frac": 0.1,
                    "cost_model": "smollm2-cpu"},
    },
    "kv-pressure": {
        "description": "KV blocks for a third of the slots at full length, all 96 requests "
                       "at once: preemption under KV pressure by recompute (the prefill is "
                       "paid again); switch to swap to keep the blocks in the host pool "
                       "(the lab charges no time for the copy: read it as swap's best case).",
        "options": {"batching": "continuous", "max_num_seqs": 16, "requests": 96,
                    "prompt_len": [100, 400], "num_kv_blocks": 300,
                    "preemption_mode": "recompute", "cost_model": "smollm2-cpu"},
    },
}


# The numbers above were chosen on a reference smollm2-cpu fit; rescale them to the fit
# shipped, so each preset stays the same experiment (lab/preset_scale.py says why).
_TYPICAL_STEP = {"longprompt": "LONGPROMPT_STEP", "longprompt-heavy": "LONGPROMPT_STEP"}


def _follow_the_shipped_fit() -> None:
    for name, p in PRESETS.items():
        step = (getattr(preset_scale, _TYPICAL_STEP[name]) if name in _TYPICAL_STEP
                else preset_scale.decode_step(p["options"]["max_num_seqs"]))
        p["options"] = preset_scale.scale_options(p["options"], preset_scale.speed(step))
        p["description"] = p["description"].format(**p["options"])


_follow_the_shipped_fit()


def apply_preset(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with its `preset` expanded: the preset's options, then the given ones on
    top (None values are "default" and do not override). The preset's cost model is a
    shipped name, loaded here (a name from the table, never a path from the caller)."""
    name = options.get("preset")
    if name is None:
        return {k: v for k, v in options.items() if k != "preset"}
    if not isinstance(name, str) or name not in PRESETS:
        raise LabOptionsError(f"preset: must be one of {', '.join(PRESETS)}; got {name!r}",
                              "preset")
    merged = dict(PRESETS[name]["options"])
    merged.update({k: v for k, v in options.items() if k != "preset" and v is not None})
    if isinstance(merged.get("cost_model"), str):
        merged["cost_model"] = load_cost_model(merged["cost_model"])
    return merged


def presets_json() -> dict[str, Any]:
    """The presets as JSON (GET /v1/lab/presets): name -> description and options."""
    return {name: {"description": p["description"], "options": dict(p["options"])}
            for name, p in PRESETS.items()}


# The lab's clock counts steps, so its timeouts do too (the engine's are in seconds).
LAB_HELP = {
    "batching": "static (a whole batch runs to completion), continuous, or both, side by side",
    "request_timeout": "simulated steps from arrival after which a request ends with "
                       "finish_reason 'timeout' (fewer output tokens than drawn)",
    "queue_timeout": "simulated steps a request may wait before admission, else it ends "
                     "with finish_reason 'timeout'",
    "max_queued_requests": "bound on the waiting queue; a full queue refuses the arrival "
                           "(counted as refused; 0: none)",
}


def _field(k: Knob, default: Any, maximum: float | None,
           help: str | None = None, choices: tuple[str, ...] | None = None
           ) -> tuple[Any, Any]:
    """(annotation, FieldInfo) for one knob, from its metadata (`choices` replaces the
    knob's own)."""
    choices = choices or k.choices
    if choices:
        kind: Any = Literal[choices]          # strict: the plain string, not the Enum
    else:
        kind = k.kind
    bounds: dict[str, Any] = {}
    if k.minimum is not None and k.kind is not bool:
        bounds["gt" if k.exclusive_minimum else "ge"] = k.minimum
    hi = maximum if maximum is not None else k.maximum
    if hi is not None:
        bounds["le"] = hi
    if k.kind is float:
        bounds["allow_inf_nan"] = False
    ann = Optional[kind] if default is None else kind
    return ann, Field(default, description=help or k.help, **bounds)


def lab_default(name: str) -> Any:
    """A shared knob's default in the lab: LAB_DEFAULTS', else the engine's on the CPU."""
    if name in LAB_DEFAULTS:
        return LAB_DEFAULTS[name][0]
    default, k, _ = _SCHEMA[name]
    value = default_on(k, default, "cpu")
    return getattr(value, "value", value)


_SCHEMA = knobs_of(SchedulerConfig, CacheConfig)


def _knob_fields() -> dict[str, tuple[Any, Any]]:
    return {name: _field(_SCHEMA[name][1], lab_default(name), LAB_MAXIMA.get(name),
                         LAB_HELP.get(name), LAB_CHOICES.get(name))
            for name in SHARED_KNOBS}


LabOptions = create_model(
    "LabOptions",
    __config__=ConfigDict(strict=True, extra="forbid"),
    __doc__="Options of one lab run (all optional; None means the default).",
    requests=(int, Field(48, ge=1, le=MAX_REQUESTS, description="number of requests")),
    seed=(Optional[int], Field(None, ge=0, description="seed of the draw")),
    short_frac=(float, Field(0.8, ge=0, le=1, allow_inf_nan=False)),
    short=(Any, Field([10, 100], description="[min, max] short output lengths")),
    long=(Any, Field([250, 500], description="[min, max] long output lengths")),
    lengths=(Any, Field(None, description="given output lengths instead of a draw")),
    arrival_rate=(Optional[float], Field(None, gt=0, allow_inf_nan=False,
                                         description="Poisson arrivals, requests per step")),
    arrival_rate_s=(Optional[float], Field(
        None, gt=0, allow_inf_nan=False,
        description="Poisson arrivals, requests per simulated second (SLO experiments)")),
    prompt_len=(Any, Field(None, description="[min, max] prompt lengths (turns prefill on)")),
    mix=(Literal["reference", "longprompt"], Field("reference")),
    priority_frac=(Optional[float], Field(None, ge=0, le=1, allow_inf_nan=False)),
    long_prompt_frac=(Optional[float], Field(
        None, ge=0, le=1, allow_inf_nan=False,
        description="mix longprompt: share of 1500-2000-token prompts (default 0.1)")),
    cost_model=(Any, Field(None, description="a cost model object or CostModel")),
    speculative_config=(Any, Field(
        None, description="speculative decoding, the engine's JSON (vLLM's): every method "
                          "proposes num_speculative_tokens drafts a step, accepted with the "
                          "per-position rates of acceptance_rates (synthetic) or "
                          "spec_acceptance (ngram, suffix)")),
    spec_acceptance=(Any, Field(
        None, description="[P1, P2, ...] the chance that draft j is accepted (unconditional, "
                          "non-increasing, as synthetic's acceptance_rates): the workload's "
                          "acceptance, which the lab's token-free prompts cannot show")),
    per_request=(bool, Field(False)),
    **_knob_fields(),
)

OPTION_DEFAULTS: dict[str, Any] = {name: f.default for name, f in LabOptions.model_fields.items()}


def _message(err: dict[str, Any]) -> str:
    t, v, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if t == "greater_than_equal":
        return f"must be at least {ctx['ge']:g}, got {v!r}"
    if t == "greater_than":
        return f"must be greater than {ctx['gt']:g}, got {v!r}"
    if t == "less_than_equal":
        return f"must be at most {ctx['le']:g}, got {v!r}"
    if t in ("int_type", "int_from_float", "int_parsing"):
        return f"expected an integer, got {v!r}"
    if t in ("float_type", "finite_number", "float_parsing"):
        return f"expected a finite number, got {v!r}"
    if t == "bool_type":
        return f"expected true or false, got {v!r}"
    if t == "literal_error":
        choices = ctx.get("expected", "").replace("'", "").replace(" or ", ", ")
        return f"must be one of {choices}; got {v!r}"
    return err.get("msg", "invalid value")


def parse_options(options: Any) -> Any:
    """`options` (a dict; None values mean "default") as a validated LabOptions."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise LabOptionsError(f"options must be an object, got {type(options).__name__}")
    options = apply_preset(options)
    for old, new in RENAMED.items():
        if old in options:
            raise LabOptionsError(f"{old}: renamed to {new}", old)
    unknown = sorted(set(options) - set(LabOptions.model_fields))
    if unknown:
        raise LabOptionsError(
            f"unknown option(s) {', '.join(map(repr, unknown))}; known options: "
            f"{', '.join(LabOptions.model_fields)}", unknown[0])
    try:
        return LabOptions.model_validate({k: v for k, v in options.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else None
        raise LabOptionsError(f"{name}: {_message(err)}", name) from None
