"""The one definition of the scheduler and KV-cache knobs (vLLM's names).

Each knob is a dataclass field whose metadata (`Knob`) holds its help text, CLI flag,
bounds and, for choices, an Enum. Everything else is derived from these fields, so a knob
is written once:

- `validate()` checks every field against its metadata, then the rules between fields;
- `engine/args.py` generates the scheduler / KV-cache flags of `iterserve serve` from them
  (`add_knob_arguments`), and builds the configs by field name (nano-vllm's `fields(Config)`);
- the lab's options (`lab/options.py`) are a pydantic model whose scheduler fields are made
  from the same metadata (`pydantic_field_specs`), so the lab, its CLI and its page have
  every knob under the same name with the same bounds.

The one cross-knob rule, kept in one place: without chunked prefill a whole
prompt must fit in one step, so the token budget must cover max_model_len. As in vLLM, a
budget that was not given (None) is raised to max_model_len; an explicit one that is too
small is a ConfigError naming the knob.
"""

from __future__ import annotations

import argparse
import enum
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Iterator


class ConfigError(ValueError):
    """A knob has a value that cannot work; the message names the knob (`knob` holds it)."""

    def __init__(self, message: str, knob: str | None = None):
        super().__init__(message)
        self.knob = knob


class SchedulingPolicy(enum.StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    SLO = "slo"            # core/slo_policy.py: admit by TTFT / TPOT targets


class Batching(enum.StrEnum):
    CONTINUOUS = "continuous"
    STATIC = "static"


class PreemptionMode(enum.StrEnum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


class RouterPolicy(enum.StrEnum):
    """How requests are spread over data-parallel replicas (core/router.py)."""
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_AWARE = "prefix_aware"


@dataclass(frozen=True, slots=True)
class Knob:
    """Metadata of one knob: enough to validate it, document it and make a flag for it."""

    help: str
    kind: type                        # int, float, bool, or an Enum class
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False   # minimum itself is not allowed (timeouts: > 0)
    nullable: bool = False            # None is a value (no limit / derived)
    flag: str | None = None           # CLI flag; default --name-with-dashes
    group: str = "scheduler"          # CLI argument group: "scheduler", "KV cache", "parallel"
    short: str | None = None          # an extra short flag (-tp), vLLM's spelling

    @property
    def choices(self) -> tuple[str, ...] | None:
        if isinstance(self.kind, type) and issubclass(self.kind, enum.Enum):
            return tuple(m.value for m in self.kind)
        return None

    def bounds_text(self) -> str:
        parts = []
        if self.minimum is not None:
            parts.append(f"{'>' if self.exclusive_minimum else '>='} {self.minimum:g}")
        if self.maximum is not None:
            parts.append(f"<= {self.maximum:g}")
        return ", ".join(parts)


def knob(default: Any, help: str, kind: type, **meta: Any) -> Any:
    """A dataclass field carrying its Knob metadata."""
    return field(default=default, metadata={"knob": Knob(help=help, kind=kind, **meta)})


def knob_fields(cls: type) -> Iterator[tuple[str, Any, Knob]]:
    """(name, default, Knob) for every knob of a config class, in declaration order."""
    for f in fields(cls):
        k = f.metadata.get("knob")
        if k is not None:
            yield f.name, (None if f.default is MISSING else f.default), k


def check_knob(name: str, value: Any, k: Knob) -> Any:
    """`value` checked (and coerced: str -> Enum, int -> float) against `k`; ConfigError
    naming the knob otherwise."""
    if value is None:
        if k.nullable:
            return None
        raise ConfigError(f"{name} must be set", name)
    if isinstance(k.kind, type) and issubclass(k.kind, enum.Enum):
        try:
            return k.kind(value)
        except ValueError:
            raise ConfigError(
                f"{name} must be one of {', '.join(k.choices)}; got {value!r}", name) from None
    if k.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}", name)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}", name)
    if k.kind is int:
        if not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}", name)
    else:
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value!r}", name)
        value = float(value)
    lo, hi = k.minimum, k.maximum
    if lo is not None and (value < lo or (k.exclusive_minimum and value == lo)):
        raise ConfigError(f"{name} must be {'greater than' if k.exclusive_minimum else 'at least'}"
                          f" {lo:g}, got {value:g}", name)
    if hi is not None and value > hi:
        raise ConfigError(f"{name} must be at most {hi:g}, got {value:g}", name)
    return value


def _check_fields(obj: Any) -> None:
    for name, _, k in knob_fields(type(obj)):
        setattr(obj, name, check_knob(name, getattr(obj, name), k))


def add_knob_argument(group: Any, name: str, k: Knob, default: Any,
                      derived_help: str | None = None) -> None:
    """One flag from a knob's metadata: --name-with-dashes, its type, choices, help text.

    Booleans get --flag / --no-flag. Values are checked by the config's validate() (so the
    CLI, the engine and the lab reject them with the same message), except choices, which
    argparse checks itself.
    """
    flag = k.flag or "--" + name.replace("_", "-")
    flags = [flag] + ([k.short] if k.short else [])
    extra = derived_help or ("" if default is None else f"default {default}")
    bounds = k.bounds_text()
    text = k.help + (f" ({extra})" if extra else "") + (f" [{bounds}]" if bounds else "")
    if k.kind is bool:
        group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                           default=default, help=text)
    elif k.choices:
        group.add_argument(*flags, dest=name, default=default, choices=list(k.choices),
                           help=text)
    else:
        group.add_argument(*flags, dest=name, type=k.kind, default=default, help=text)


DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


@dataclass(slots=True)
class CacheConfig:
    block_size: int = knob(16, "tokens per KV block", int, minimum=1, group="KV cache")
    num_kv_blocks: int = knob(1024, "device KV blocks", int, minimum=1, group="KV cache")
    num_swap_blocks: int = knob(0, "host KV blocks for preemption by swap", int, minimum=0,
                                group="KV cache")
    enable_prefix_caching: bool = knob(True, "share the KV blocks of common prompt prefixes",
                                       bool, group="KV cache")
    num_ram_tier_blocks: int = knob(
        0, "host RAM slots that keep cached blocks the pool evicts (the KV tiers, "
        "core/kv_tiers.py)", int, minimum=0, group="KV cache")
    num_disk_tier_blocks: int = knob(
        0, "blocks the disk tier may hold (one file each)", int, minimum=0, group="KV cache")

    def validate(self) -> "CacheConfig":
        _check_fields(self)
        if (self.num_ram_tier_blocks or self.num_disk_tier_blocks) \
                and not self.enable_prefix_caching:
            raise ConfigError("the KV tiers keep prefix-cache blocks: they need "
                              "enable_prefix_caching", "num_ram_tier_blocks")
        if self.num_disk_tier_blocks and not self.num_ram_tier_blocks:
            raise ConfigError("the disk tier is read back through RAM tier slots: "
                              "num_disk_tier_blocks needs num_ram_tier_blocks",
                              "num_ram_tier_blocks")
        return self


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = knob(64, "sequences per step", int, minimum=1)
    max_num_batched_tokens: int | None = knob(
        None, "token budget per step", int,
        minimum=1, nullable=True)
    max_model_len: int = knob(2048, "prompt + output tokens per request", int, minimum=2)
    enable_chunked_prefill: bool = knob(True, "split long prompts over several steps", bool)
    long_prefill_token_threshold: int = knob(
        0, "cap on one request's prefill chunk (0: none)", int, minimum=0)
    max_num_partial_prefills: int = knob(1, "prompts mid-prefill at once", int, minimum=1)
    max_long_partial_prefills: int | None = knob(
        None, "of the prompts mid-prefill, how many may be long (more than "
        "long_prefill_token_threshold tokens left); a long prompt over the cap is passed over "
        "for shorter ones behind it (vLLM's, whose default is 1; applies when "
        "max_num_partial_prefills > 1)", int, minimum=1, nullable=True)
    max_long_prefill_tokens: int = knob(
        0, "tokens per step that long prompts (more than long_prefill_token_threshold "
        "tokens) may take in all, so the step that ends one long prefill and starts the "
        "next is no longer than the others: one long chunk's worth per step, whatever "
        "the budget leaves (0: no cap)", int, minimum=0)
    scheduling_policy: SchedulingPolicy = knob(
        SchedulingPolicy.FCFS, "queue order (priority: lower value first, may preempt)",
        SchedulingPolicy)
    batching: Batching = knob(Batching.CONTINUOUS,
                              "continuous, or static (a whole batch runs to completion)", Batching)
    preemption_mode: PreemptionMode = knob(
        PreemptionMode.RECOMPUTE, "what happens to a request evicted for KV room", PreemptionMode)
    max_queued_requests: int = knob(
        0, "bound on the waiting queue; beyond it requests get 503 (0: none)", int, minimum=0)
    request_timeout: float | None = knob(
        None, "seconds from arrival after which a request ends with finish_reason 'timeout'",
        float, minimum=0, exclusive_minimum=True, nullable=True)
    queue_timeout: float | None = knob(
        None, "seconds a request may wait before admission", float, minimum=0,
        exclusive_minimum=True, nullable=True)
    # --- scheduling_policy "priority": short steps while an urgent class is active -----
    priority_less_urgent_tokens: int = knob(
        0, "scheduling_policy priority: while a more urgent request runs, waits or was seen "
        "in the last priority_guard_steps steps, less urgent requests get at most this many "
        "tokens per step in all, so the step in flight when an urgent request arrives is "
        "short (0: no cap)", int, minimum=0)
    priority_guard_steps: int = knob(
        500, "scheduling_policy priority: steps an urgent class stays active after its last "
        "request was seen (for priority_less_urgent_tokens)", int, minimum=0)
    # --- scheduling_policy "slo" (core/slo_policy.py) -----------------------------------
    slo_ttft_ms: float | None = knob(
        None, "scheduling_policy slo: default time-to-first-token target (ms); a request "
        "that cannot meet it is refused early (429 + Retry-After)", float, minimum=0,
        exclusive_minimum=True, nullable=True)
    slo_tpot_ms: float | None = knob(
        None, "scheduling_policy slo: default time-per-output-token target (ms); admission "
        "holds before one more decode would break it", float, minimum=0,
        exclusive_minimum=True, nullable=True)
    # Not a knob (a path or a shipped name, not a number): the cost model the slo policy's
    # online step-time model starts from; None = the shipped "smollm2-cpu".
    slo_cost_model: str | None = None

    def validate(self, default_max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
                 ) -> "SchedulerConfig":
        """Check every knob, then resolve the budget (None: the caller's default, raised to
        max_model_len without chunked prefill). Idempotent."""
        _check_fields(self)
        if (self.max_long_partial_prefills is not None
                and self.max_long_partial_prefills > self.max_num_partial_prefills):
            raise ConfigError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})",
                "max_long_partial_prefills")
        if (self.max_long_partial_prefills is not None and not self.long_prefill_token_threshold
                and self.max_long_partial_prefills < self.max_num_partial_prefills):
            # vLLM then makes "long" 4% of the context and caps every chunk there; here the
            # chunk cap stays what the user set, so the threshold must be given.
            raise ConfigError(
                "max_long_partial_prefills needs long_prefill_token_threshold (the prompt "
                "length above which a prefill counts as long)", "max_long_partial_prefills")
        if self.max_long_prefill_tokens and not self.long_prefill_token_threshold:
            raise ConfigError(
                "max_long_prefill_tokens needs long_prefill_token_threshold (the prompt "
                "length above which a prefill counts as long)", "max_long_prefill_tokens")
        if self.max_num_batched_tokens is None:
            budget = default_max_num_batched_tokens
            if not self.enable_chunked_prefill:
                budget = max(budget, self.max_model_len)
            self.max_num_batched_tokens = budget
        elif not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) without chunked prefill, or a long "
                "prompt could never be scheduled; raise it, leave it unset or turn chunked "
                "prefill on", "max_num_batched_tokens")
        return self


class KernelActivations(enum.StrEnum):
    """How the CPU decode kernels treat activations (model/kernels/qdot8.c)."""
    AUTO = "auto"      # the measured default: int8 up to per-type row counts (qdot8.c)
    FLOAT = "float"    # float32 activations: equal to a float GEMM up to summation order
    INT8 = "int8"      # rows quantised to 8 bits, integer dot products (llama.cpp's scheme)


class OmpWaitPolicy(enum.StrEnum):
    """What idle OpenMP threads of the CPU kernels do between parallel regions
    (engine/omp_policy.py applies it before torch loads libgomp)."""
    ENV = "env"          # leave OMP_WAIT_POLICY as the environment has it (libgomp's default)
    AUTO = "auto"        # passive when the CPUs are already busy at start, else as env
    ACTIVE = "active"    # spin: the fastest hand-off between regions on an idle machine
    PASSIVE = "passive"  # sleep: no spinning thread takes a core another process needs


@dataclass(slots=True)
class KernelConfig:
    """How the model's native CPU kernels compute, set when the model loads."""

    kernel_activations: KernelActivations = knob(
        KernelActivations.AUTO, "GEMM activations over GGUF weights: int8 (quantised rows, integer dot "
        "products, as llama.cpp; about 0.5 percent relative error per output), float (float32, equal to "
        "a float GEMM up to summation order) or auto (int8 where it measured faster: decode "
        "K-quants up to 32 rows, Q4_0/Q4_1/Q5_0/Q5_1 up to 32 on AVX-512 VBMI CPUs, else 8, "
        "Q8_0 up to 8; prefill chunks of more than 32 rows of these types; bf16 dot products "
        "for BF16 weights, and F16 from 16 rows, on avx512bf16 CPUs)", KernelActivations,
        group="model")
    omp_wait_policy: OmpWaitPolicy = knob(
        OmpWaitPolicy.ENV, "idle OpenMP threads: env (as OMP_WAIT_POLICY says, libgomp "
        "spins by default), active, passive (sleep: on a machine whose cores other "
        "processes use, spinning threads made a decode step 10-100x slower), or auto "
        "(passive when the 1-minute load average at start is at least the usable CPUs); "
        "applied by `iterserve serve` before torch loads, an OMP_WAIT_POLICY in the "
        "environment wins", OmpWaitPolicy, group="model")

    def validate(self) -> "KernelConfig":
        _check_fields(self)
        return self


@dataclass(slots=True)
class ParallelConfig:
    """How one served model is spread over processes. Data parallel: N whole
    engine replicas behind one endpoint (Ray Serve), a request goes to one of them by
    `router`. Tensor parallel: one engine whose weights are split over N ranks
    (torch.distributed), the scheduler on rank 0."""

    data_parallel_size: int = knob(1, "engine replicas behind the one endpoint (Ray Serve)",
                                   int, minimum=1, group="parallel", short="-dp")
    tensor_parallel_size: int = knob(1, "ranks one model's weights are split over "
                                     "(torch.distributed)", int, minimum=1,
                                     group="parallel", short="-tp")
    router: RouterPolicy = knob(RouterPolicy.LEAST_LOADED,
                                "how requests are spread over replicas", RouterPolicy,
                                group="parallel")
    threads_per_replica: int | None = knob(
        None, "OpenMP threads of each replica or rank (default: the cores / replicas)", int,
        minimum=1, nullable=True, group="parallel")

    def validate(self) -> "ParallelConfig":
        _check_fields(self)
        return self
