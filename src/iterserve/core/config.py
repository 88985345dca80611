"""Scheduler and KV-cache knobs as small dataclasses (vLLM's names where one exists).

The same objects configure the real engine (CLI flags of `iterserve serve`) and the lab.
"""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A knob has a value that cannot work; the message names the knob."""


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16                 # tokens per KV block
    num_blocks: int = 1024               # device (GPU/CPU) pool
    num_swap_blocks: int = 0             # host pool for preemption by swap
    enable_prefix_caching: bool = False

    def validate(self) -> "CacheConfig":
        if self.block_size < 1:
            raise ConfigError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.num_swap_blocks < 0:
            raise ConfigError(f"num_swap_blocks must be non-negative, got {self.num_swap_blocks}")
        return self


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64               # sequences in one step
    max_num_batched_tokens: int = 512    # token budget of one step
    max_model_len: int = 2048            # prompt + output tokens of one request
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0   # cap on one request's prefill chunk (0 = none)
    max_num_partial_prefills: int = 1       # prompts mid-prefill at once
    policy: str = "fcfs"                 # fcfs | priority | slo
    batching: str = "continuous"         # continuous | static
    preemption_mode: str = "recompute"   # recompute | swap
    max_queued_requests: int = 0         # waiting-queue bound (0 = unbounded)
    request_timeout: float | None = None  # default per-request deadline, seconds from arrival
    queue_timeout: float | None = None    # default limit on time spent waiting before admission
    # --- policy "slo" (core/slo_policy.py): default per-request targets, and the cost
    # model (file or shipped name) its online step-time model starts from.
    slo_ttft_ms: float | None = None      # time to first token target (None: no target)
    slo_tpot_ms: float | None = None      # time per output token target (None: no target)
    slo_cost_model: str | None = None     # None: the shipped "smollm2-cpu"

    def validate(self) -> "SchedulerConfig":
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}), "
                "or a long prompt could never be scheduled")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be non-negative")
        if self.max_num_partial_prefills < 1:
            raise ConfigError("max_num_partial_prefills must be at least 1")
        if self.policy not in ("fcfs", "priority", "slo"):
            raise ConfigError(
                f"policy must be 'fcfs', 'priority' or 'slo', got {self.policy!r}")
        if self.batching not in ("continuous", "static"):
            raise ConfigError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_queued_requests < 0:
            raise ConfigError("max_queued_requests must be non-negative")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None and not 0 < v < float("inf"):
                raise ConfigError(f"{name} must be a positive finite number, got {v}")
        for name in ("request_timeout", "queue_timeout"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be positive, got {v}")
        return self
