"""EngineArgs: every knob of the engine in one dataclass, and its command-line flags.

Flag spellings follow vLLM (`--max-num-seqs`, `--enable-chunked-prefill`, ...) so a command
line written for `vllm serve` mostly works for `iterserve serve`. The defaults are chosen for
a small model on a CPU, where a step's cost grows with its token count (a prefill chunk adds
about 1.2 ms per token to *everyone's* step on a laptop-class core):

- max_num_seqs 32: a decode step of 32 sequences still costs a few tens of ms.
- max_num_batched_tokens 256: caps the stall a long prompt's prefill chunk causes.
- max_model_len: the model's max_position_embeddings, capped at 2048.
- KV pool: `--num-kv-blocks` if given, else as many blocks as fit in `--kv-cache-memory`
  GiB (default 1 GiB) at `ModelRunner.kv_cache_bytes_per_block` bytes each.
- swap pool: `--swap-space` GiB (vLLM's flag); with `--preemption-mode swap` and no swap
  space given, a pool as large as the device pool, so swap mode works out of the box.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from iterserve.core.config import CacheConfig, ConfigError, SchedulerConfig

GiB = 1 << 30
DEFAULT_MAX_MODEL_LEN_CAP = 2048


@dataclass
class EngineArgs:
    model: str | None = None                 # HF directory or .gguf file; None: bundled default
    served_model_name: str | None = None     # the name clients send as "model"
    dtype: str = "auto"                      # auto: the checkpoint's weights as stored
    device: str = "cpu"
    seed: int = 0                            # torch seed for unseeded sampling
    # scheduler
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None         # None: min(model limit, 2048)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    batching: str = "continuous"
    max_queued_requests: int = 0
    request_timeout: float | None = None     # seconds from arrival; None: no limit
    queue_timeout: float | None = None       # seconds waiting before admission
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: float = 1.0             # GiB, used when num_kv_blocks is None
    kv_cache_dtype: str = "auto"             # auto: the compute dtype (float32 on CPU)
    swap_space: float | None = None          # GiB of host swap pool
    num_swap_blocks: int | None = None       # overrides swap_space (tests, the lab)
    enable_prefix_caching: bool = False
    # observability
    max_finished_requests: int = 1000        # finished requests kept for /trace
    step_history_len: int = 300              # steps kept for the live view

    # --- configs ------------------------------------------------------------------------
    def resolve_max_model_len(self, model_limit: int | None) -> int:
        if self.max_model_len is not None:
            if model_limit is not None and self.max_model_len > model_limit:
                raise ConfigError(
                    f"max_model_len {self.max_model_len} exceeds the model's limit "
                    f"(max_position_embeddings = {model_limit})")
            return self.max_model_len
        return min(model_limit or DEFAULT_MAX_MODEL_LEN_CAP, DEFAULT_MAX_MODEL_LEN_CAP)

    def create_scheduler_config(self, model_limit: int | None = None) -> SchedulerConfig:
        max_model_len = self.resolve_max_model_len(model_limit)
        batched = self.max_num_batched_tokens
        if not self.enable_chunked_prefill and batched < max_model_len:
            # Without chunking a whole prompt must fit in one step (vLLM raises the budget the
            # same way rather than refusing to start).
            batched = max_model_len
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            policy=self.scheduling_policy,
            batching=self.batching,
            preemption_mode=self.preemption_mode,
            max_queued_requests=self.max_queued_requests,
            request_timeout=self.request_timeout,
            queue_timeout=self.queue_timeout,
        ).validate()

    def create_cache_config(self, bytes_per_block: int | None = None) -> CacheConfig:
        """Block counts from the explicit counts, else from the memory budgets."""
        if self.num_kv_blocks is not None:
            num_blocks = self.num_kv_blocks
        else:
            if not bytes_per_block:
                raise ConfigError("num_kv_blocks is needed when the block size in bytes is unknown")
            if self.kv_cache_memory <= 0:
                raise ConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
            num_blocks = int(self.kv_cache_memory * GiB // bytes_per_block)
            if num_blocks < 1:
                raise ConfigError(
                    f"kv_cache_memory {self.kv_cache_memory} GiB holds no block of "
                    f"{bytes_per_block} bytes")
        if self.num_swap_blocks is not None:
            num_swap = self.num_swap_blocks
        elif self.swap_space is not None:
            if self.swap_space < 0:
                raise ConfigError(f"swap_space must be non-negative, got {self.swap_space}")
            num_swap = int(self.swap_space * GiB // bytes_per_block) if bytes_per_block else 0
        else:
            num_swap = num_blocks if self.preemption_mode == "swap" else 0
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            num_swap_blocks=num_swap,
            enable_prefix_caching=self.enable_prefix_caching,
        ).validate()

    # --- command line -------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()
        g = parser.add_argument_group("model")
        g.add_argument("--model", default=d.model,
                       help="HF model directory or .gguf file (default: the bundled "
                            "SmolLM2-135M-Instruct)")
        g.add_argument("--served-model-name", default=d.served_model_name,
                       help="model name clients use (default: derived from --model)")
        g.add_argument("--dtype", default=d.dtype,
                       choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
                       help="compute dtype; auto (default) keeps the weights as the checkpoint "
                            "stores them and computes in float32 on CPU")
        g.add_argument("--device", default=d.device, help="torch device (default: cpu)")
        g.add_argument("--seed", type=int, default=d.seed)

        g = parser.add_argument_group("scheduler")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                       help=f"sequences per step (default {d.max_num_seqs})")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help=f"token budget per step (default {d.max_num_batched_tokens})")
        g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                       help="prompt + output tokens per request (default: model limit, "
                            f"at most {DEFAULT_MAX_MODEL_LEN_CAP})")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=d.enable_chunked_prefill)
        g.add_argument("--long-prefill-token-threshold", type=int,
                       default=d.long_prefill_token_threshold)
        g.add_argument("--max-num-partial-prefills", type=int,
                       default=d.max_num_partial_prefills)
        g.add_argument("--scheduling-policy", default=d.scheduling_policy,
                       choices=["fcfs", "priority"])
        g.add_argument("--preemption-mode", default=d.preemption_mode,
                       choices=["recompute", "swap"])
        g.add_argument("--batching", default=d.batching, choices=["continuous", "static"])
        g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                       help="bound on the waiting queue; beyond it requests get 503 (0: none)")
        g.add_argument("--request-timeout", type=float, default=d.request_timeout,
                       help="seconds from arrival after which a request ends with "
                            "finish_reason 'timeout'")
        g.add_argument("--queue-timeout", type=float, default=d.queue_timeout,
                       help="seconds a request may wait before admission")

        g = parser.add_argument_group("KV cache")
        g.add_argument("--block-size", type=int, default=d.block_size)
        g.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                       help="device KV blocks (overrides --kv-cache-memory)")
        g.add_argument("--kv-cache-memory", type=float, default=d.kv_cache_memory,
                       help=f"GiB for the KV cache (default {d.kv_cache_memory})")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                       choices=["auto", "float32", "float16", "bfloat16"],
                       help="KV cache dtype (default auto: the compute dtype, float32 on CPU); "
                            "float16/bfloat16 halve KV memory")
        g.add_argument("--swap-space", type=float, default=d.swap_space,
                       help="GiB of host memory for swapped-out KV blocks")
        g.add_argument("--num-swap-blocks", type=int, default=d.num_swap_blocks,
                       help="host swap blocks (overrides --swap-space)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def replace(self, **changes: Any) -> "EngineArgs":
        return dataclasses.replace(self, **changes)
