"""EngineArgs: every knob of the engine in one dataclass, and its command-line flags.

The scheduler and KV-cache knobs are defined once, in core/config.py (name, type, bounds,
help): the flags below are generated from that schema (`add_knob_argument`) and the configs
are built by field name, so EngineArgs only adds its CPU defaults and the knobs that exist
only here (model, device, KV memory budgets, observability).

Flag spellings follow vLLM (`--max-num-seqs`, `--enable-chunked-prefill`, ...) so a command
line written for `vllm serve` mostly works for `iterserve serve`. The defaults are chosen for
a small model on a CPU, where a step's cost grows with its token count (a prefill chunk adds
about 1.2 ms per token to *everyone's* step on a laptop-class core):

- max_num_seqs 32: a decode step of 32 sequences still costs a few tens of ms.
- max_num_batched_tokens 256: caps the stall a long prompt's prefill chunk causes (without
  chunked prefill it is raised to max_model_len; an explicit smaller value is an error).
- max_model_len: the model's max_position_embeddings, capped at 2048.
- KV pool: `--num-kv-blocks` if given, else as many blocks as fit in `--kv-cache-memory`
  GiB (default 1 GiB) at `ModelRunner.kv_cache_bytes_per_block` bytes each.
- swap pool: `--swap-space` GiB (vLLM's flag); with `--preemption-mode swap` and no swap
  space given, a pool as large as the device pool, so swap mode works out of the box.
- KV tiers (core/kv_tiers.py): `--kv-offload-dir DIR` writes every cached block through to
  DIR, at most `--kv-offload-gib` GiB of block files, and reads them back across restarts;
  `--kv-offload-ram-gib` GiB of host RAM keep blocks the pool evicts (by default: on a GPU
  as much as the device pool, at most 4 GiB; on the CPU none, or with a disk tier a quarter
  of the pool and at least two max_model_len prompts, the slots disk reads land in).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from iterserve.core.config import (
    CacheConfig, ConfigError, KernelConfig, ParallelConfig, SchedulerConfig, add_knob_argument,
    check_knob, knob_fields)

GiB = 1 << 30
DEFAULT_MAX_MODEL_LEN_CAP = 2048
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256     # used when --max-num-batched-tokens is not given
_CACHE_KNOBS = {name: k for name, _, k in knob_fields(CacheConfig)}

# Knobs whose engine default is derived rather than a number: the flag's help says how.
_DERIVED_HELP = {
    "max_num_batched_tokens": f"default {DEFAULT_MAX_NUM_BATCHED_TOKENS}; without chunked "
                              "prefill, max_model_len",
    "max_model_len": f"default: the model's limit, at most {DEFAULT_MAX_MODEL_LEN_CAP}",
    "num_kv_blocks": "default: as many as fit in --kv-cache-memory; overrides it",
    "num_swap_blocks": "default: from --swap-space; with --preemption-mode swap and no swap "
                       "space, as many as the device pool; overrides --swap-space",
    "enable_prefix_caching": "default on",
    "num_ram_tier_blocks": "default: from --kv-offload-ram-gib; overrides it",
    "num_disk_tier_blocks": "default: from --kv-offload-gib with --kv-offload-dir; "
                            "overrides it",
}
DEFAULT_KV_OFFLOAD_GIB = 8.0           # the disk tier's bound when only the directory is given
DEFAULT_GPU_RAM_TIER_GIB = 4.0         # a GPU pool's RAM tier at most, unless given


@dataclass
class EngineArgs:
    model: str | None = None                 # HF directory or .gguf file; None: bundled default
    served_model_name: str | None = None     # the name clients send as "model"
    tokenizer: str | None = None             # a tokenizer other than the model's (vLLM's)
    dtype: str = "auto"                      # auto: the checkpoint's weights as stored
    device: str = "cpu"
    seed: int = 0                            # torch seed for unseeded sampling
    # scheduler
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None   # None: 256, or max_model_len unchunked
    max_model_len: int | None = None         # None: min(model limit, 2048)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int | None = None   # None: max_num_partial_prefills
    max_long_prefill_tokens: int = 0         # long prompts' tokens per step in all (0: none)
    priority_less_urgent_tokens: int = 0     # scheduling_policy priority: cap while urgent
    priority_guard_steps: int = 500
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    batching: str = "continuous"
    max_queued_requests: int = 0
    request_timeout: float | None = None     # seconds from arrival; None: no limit
    queue_timeout: float | None = None       # seconds waiting before admission
    slo_ttft_ms: float | None = None         # scheduling_policy slo: default TTFT target
    slo_tpot_ms: float | None = None         # scheduling_policy slo: default TPOT target
    slo_cost_model: str | None = None        # scheduling_policy slo: step-time seed (not a knob)
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: float = 1.0             # GiB, used when num_kv_blocks is None
    kv_cache_dtype: str = "auto"             # auto: the compute dtype (float32 on CPU)
    swap_space: float | None = None          # GiB of host swap pool
    num_swap_blocks: int | None = None       # overrides swap_space (tests, the lab)
    enable_prefix_caching: bool = True
    # KV tiers below the pool (core/kv_tiers.py, model/kv_tier_store.py)
    kv_offload_dir: str | None = None        # the disk tier's directory (None: no disk tier)
    kv_offload_gib: float = DEFAULT_KV_OFFLOAD_GIB   # bound on its block files
    kv_offload_ram_gib: float | None = None  # None: derived (module docstring)
    num_ram_tier_blocks: int | None = None   # override the GiB (tests)
    num_disk_tier_blocks: int | None = None
    # parallel (core/config.py ParallelConfig)
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    router: str = "least_loaded"
    threads_per_replica: int | None = None
    # kernels (core/config.py KernelConfig)
    kernel_activations: str = "auto"
    omp_wait_policy: str = "env"             # applied by the CLI (engine/omp_policy.py)
    # observability
    max_finished_requests: int = 1000        # finished requests kept for /trace
    step_history_len: int = 300              # steps kept for the live view

    # --- configs ------------------------------------------------------------------------
    def resolve_max_model_len(self, model_limit: int | None) -> int:
        if self.max_model_len is not None:
            if model_limit is not None and self.max_model_len > model_limit:
                raise ConfigError(
                    f"max_model_len {self.max_model_len} exceeds the model's limit "
                    f"(max_position_embeddings = {model_limit})", "max_model_len")
            return self.max_model_len
        return min(model_limit or DEFAULT_MAX_MODEL_LEN_CAP, DEFAULT_MAX_MODEL_LEN_CAP)

    def create_scheduler_config(self, model_limit: int | None = None) -> SchedulerConfig:
        """Every SchedulerConfig knob by name (the schema is core/config.py). The budget,
        when not given, is DEFAULT_MAX_NUM_BATCHED_TOKENS, raised to max_model_len without
        chunked prefill; an explicit budget below it is a ConfigError (as in vLLM)."""
        knobs = {name: getattr(self, name) for name, _, _ in knob_fields(SchedulerConfig)}
        knobs["max_model_len"] = self.resolve_max_model_len(model_limit)
        knobs["slo_cost_model"] = self.slo_cost_model
        return SchedulerConfig(**knobs).validate(
            default_max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS)

    def create_cache_config(self, bytes_per_block: int | None = None, *,
                            disk_file_bytes: int | None = None,
                            max_model_len: int | None = None) -> CacheConfig:
        """Block counts from the explicit counts, else from the memory budgets
        (`disk_file_bytes`: one block file's size, for the disk tier's bound)."""
        if self.num_kv_blocks is not None:
            num_blocks = check_knob("num_kv_blocks", self.num_kv_blocks, _CACHE_KNOBS["num_kv_blocks"])
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
        num_disk = self._disk_tier_blocks(disk_file_bytes or bytes_per_block)
        num_ram = self._ram_tier_blocks(bytes_per_block, num_blocks, num_disk, max_model_len)
        return CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=num_blocks,
            num_swap_blocks=num_swap,
            enable_prefix_caching=self.enable_prefix_caching,
            num_ram_tier_blocks=num_ram,
            num_disk_tier_blocks=num_disk,
        ).validate()

    def _disk_tier_blocks(self, file_bytes: int | None) -> int:
        if not self.kv_offload_dir:
            if self.num_disk_tier_blocks:
                raise ConfigError("num_disk_tier_blocks needs --kv-offload-dir",
                                  "num_disk_tier_blocks")
            return 0
        if not self.enable_prefix_caching:
            raise ConfigError("--kv-offload-dir keeps prefix-cache blocks: it needs "
                              "--enable-prefix-caching", "kv_offload_dir")
        if self.num_disk_tier_blocks is not None:
            return self.num_disk_tier_blocks
        if not self.kv_offload_gib > 0:
            raise ConfigError(f"kv_offload_gib must be positive, got {self.kv_offload_gib}",
                              "kv_offload_gib")
        if not file_bytes:
            raise ConfigError("num_disk_tier_blocks is needed when the block size in bytes "
                              "is unknown", "num_disk_tier_blocks")
        n = int(self.kv_offload_gib * GiB // file_bytes)
        if n < 1:
            raise ConfigError(f"kv_offload_gib {self.kv_offload_gib} holds no block file of "
                              f"{file_bytes} bytes", "kv_offload_gib")
        return n

    def _ram_tier_blocks(self, bytes_per_block: int | None, num_blocks: int, num_disk: int,
                         max_model_len: int | None) -> int:
        if self.num_ram_tier_blocks is not None:
            return self.num_ram_tier_blocks
        if not self.enable_prefix_caching:
            if self.kv_offload_ram_gib:
                raise ConfigError("--kv-offload-ram-gib keeps prefix-cache blocks: it needs "
                                  "--enable-prefix-caching", "kv_offload_ram_gib")
            return 0
        if self.kv_offload_ram_gib is not None:
            if self.kv_offload_ram_gib < 0:
                raise ConfigError(f"kv_offload_ram_gib must be non-negative, got "
                                  f"{self.kv_offload_ram_gib}", "kv_offload_ram_gib")
            if not bytes_per_block:
                raise ConfigError("num_ram_tier_blocks is needed when the block size in bytes "
                                  "is unknown", "num_ram_tier_blocks")
            n = int(self.kv_offload_ram_gib * GiB // bytes_per_block)
            if num_disk and n < 1:
                raise ConfigError("the disk tier reads blocks back into the RAM tier: "
                                  "--kv-offload-ram-gib must hold at least one block",
                                  "kv_offload_ram_gib")
            return n
        if self.device.startswith("cuda") and bytes_per_block:
            return min(num_blocks, int(DEFAULT_GPU_RAM_TIER_GIB * GiB // bytes_per_block))
        if num_disk:                 # the slots disk reads land in (core/kv_tiers.py)
            prompt = -(-(max_model_len or DEFAULT_MAX_MODEL_LEN_CAP) // self.block_size)
            return min(num_disk, max(num_blocks // 4, 2 * prompt))
        return 0

    def create_parallel_config(self) -> ParallelConfig:
        return ParallelConfig(**{name: getattr(self, name)
                                 for name, _, _ in knob_fields(ParallelConfig)}).validate()

    def create_kernel_config(self) -> KernelConfig:
        return KernelConfig(**{name: getattr(self, name)
                               for name, _, _ in knob_fields(KernelConfig)}).validate()

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
        g.add_argument("--tokenizer", default=d.tokenizer, metavar="PATH",
                       help="a tokenizer other than the model's: an HF tokenizer directory, a "
                            "tokenizer.json file or a .gguf file (default: the model's own)")
        g.add_argument("--dtype", default=d.dtype,
                       choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
                       help="compute dtype; auto (default) keeps the weights as the checkpoint "
                            "stores them and computes in float32 on CPU")
        g.add_argument("--device", default=d.device, help="torch device (default: cpu)")
        g.add_argument("--seed", type=int, default=d.seed)

        groups = {"scheduler": parser.add_argument_group("scheduler"),
                  "KV cache": parser.add_argument_group("KV cache"),
                  "parallel": parser.add_argument_group("parallel"), "model": g}
        for cls in (SchedulerConfig, CacheConfig, ParallelConfig, KernelConfig):
            for name, _, k in knob_fields(cls):
                add_knob_argument(groups[k.group], name, k, getattr(d, name),
                                  _DERIVED_HELP.get(name))
        groups["scheduler"].add_argument(
            "--slo-cost-model", default=d.slo_cost_model, metavar="FILE|NAME",
            help="scheduling_policy slo: the cost model its online step-time model starts "
                 "from (a JSON file or a shipped name; default smollm2-cpu)")
        g = groups["KV cache"]
        g.add_argument("--kv-cache-memory", type=float, default=d.kv_cache_memory,
                       help=f"GiB for the KV cache (default {d.kv_cache_memory})")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                       choices=["auto", "float32", "float16", "bfloat16"],
                       help="KV cache dtype (default auto: the compute dtype, float32 on CPU); "
                            "float16/bfloat16 halve KV memory")
        g.add_argument("--swap-space", type=float, default=d.swap_space,
                       help="GiB of host memory for swapped-out KV blocks")
        g.add_argument("--kv-offload-dir", default=d.kv_offload_dir, metavar="DIR",
                       help="a disk tier for the prefix cache: every cached block is written "
                            "to DIR and read back when a prompt needs it again, also after "
                            "a restart (default: none). Blocks are keyed by the model files, "
                            "dtypes and block size; replicas and restarts share DIR")
        g.add_argument("--kv-offload-gib", type=float, default=d.kv_offload_gib,
                       metavar="GiB", help="with --kv-offload-dir: GiB of block files kept, "
                       f"least recently used evicted first (default {d.kv_offload_gib:g}; "
                       "per replica)")
        g.add_argument("--kv-offload-ram-gib", type=float, default=d.kv_offload_ram_gib,
                       metavar="GiB", help="host RAM that keeps cached blocks the KV pool "
                       "evicts, and where disk reads land (default: on a GPU the pool's size "
                       f"up to {DEFAULT_GPU_RAM_TIER_GIB:g} GiB; on the CPU none, or with "
                       "--kv-offload-dir a quarter of the pool, at least two max_model_len "
                       "prompts)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def replace(self, **changes: Any) -> "EngineArgs":
        return dataclasses.replace(self, **changes)
