"""EngineArgs: every knob of the engine in one dataclass, and its command-line flags.

EngineArgs has one field per knob of `core.config.ENGINE_CONFIGS` (load, scheduler, KV
cache, parallel, kernels, observability), generated from the schema with the same name, Knob
metadata and default, so a knob declared there is a keyword of `LLM(...)` and a flag of
`iterserve serve` / `iterserve generate` at once. A knob whose default depends on the device
or on the model (`Knob.late_default`: max_num_seqs, the token budget, max_model_len, the KV
block counts) is None here until `create_*_config` resolves it:

- max_num_seqs, max_num_batched_tokens: the knob's default for `device` (core/config.py
  says why the CPU's are small); without chunked prefill the budget is raised to
  max_model_len, and an explicit smaller one is an error;
- max_model_len: the model's max_position_embeddings, capped at the knob's 2048;
- KV pool: `--num-kv-blocks` if given, else as many blocks as fit in the KV budget at
  `ModelRunner.kv_cache_bytes_per_block` bytes each: `--kv-cache-memory-bytes`, else (on a
  CUDA device) what `--gpu-memory-utilization` leaves (engine/builder.py measures it),
  else `--kv-cache-memory` GiB;
- swap pool: `--swap-space` GiB (vLLM's flag); with `--preemption-mode swap` and no swap
  space given, a pool as large as the device pool, so swap mode works out of the box.
- KV tiers (core/kv_tiers.py): `--kv-offload-dir DIR` writes every cached block through to
  DIR, at most `--kv-offload-gib` GiB of block files, and reads them back across restarts;
  `--kv-offload-ram-gib` GiB of host RAM keep blocks the pool evicts (by default: on a GPU
  as much as the device pool, at most 4 GiB; on the CPU none, or with a disk tier a quarter
  of the pool and at least two max_model_len prompts, the slots disk reads land in).

Flag spellings follow vLLM (`--max-num-seqs`, `--enable-chunked-prefill`, ...) so a command
line written for `vllm serve` mostly works for `iterserve serve`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from iterserve.core.config import (
    ENGINE_CONFIGS, CacheConfig, KernelConfig, LoadConfig, LoRAConfig, MultiModalConfig,
    ObservabilityConfig, ParallelConfig, SchedulerConfig,
    add_config_arguments, check_knob, default_on, knob_fields)
from iterserve.errors import ConfigError

GiB = 1 << 30
_SCHEDULER = {name: (default, k) for name, default, k in knob_fields(SchedulerConfig)}
_CACHE = {name: (default, k) for name, default, k in knob_fields(CacheConfig)}
DEFAULT_MAX_MODEL_LEN_CAP = _SCHEDULER["max_model_len"][0]

DEFAULT_GPU_RAM_TIER_GIB = 4.0         # a GPU pool's RAM tier at most, unless given

def _with_knob_fields(*configs: type):
    """Class decorator (below @dataclass): one field per knob of `configs`, carrying the
    knob's metadata; its default is the knob's, or None where `late_default` (resolved by
    `create_*_config`). Enum defaults are given as their plain strings."""
    def wrap(cls: type) -> type:
        annotations: dict[str, Any] = {}
        for config in configs:
            for f in dataclasses.fields(config):
                k = f.metadata.get("knob")
                if k is None:
                    continue
                default = None if k.late_default else getattr(f.default, "value", f.default)
                kind = str if k.choices else k.kind
                annotations[f.name] = kind if default is not None else kind | None
                setattr(cls, f.name, dataclasses.field(default=default, metadata=f.metadata))
        cls.__annotations__ = {**annotations, **cls.__dict__.get("__annotations__", {})}
        return cls
    return wrap


@dataclass
@_with_knob_fields(*ENGINE_CONFIGS)
class EngineArgs:
    # --- configs ------------------------------------------------------------------------
    def _knobs_for(self, config: type) -> dict[str, Any]:
        """`config`'s knobs from these args, device defaults filled in (the derived ones stay
        None for their own rule)."""
        values = {}
        for name, default, k in knob_fields(config):
            value = getattr(self, name)
            if value is None and k.derived is None and k.device_default is not None:
                value = default_on(k, default, self.device)
            values[name] = value
        return values

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
        when not given, is the knob's default for the device, raised to max_model_len
        without chunked prefill; an explicit budget below it is a ConfigError (as in vLLM)."""
        knobs = self._knobs_for(SchedulerConfig)
        knobs["max_model_len"] = self.resolve_max_model_len(model_limit)
        default, k = _SCHEDULER["max_num_batched_tokens"]
        return SchedulerConfig(**knobs).validate(
            default_max_num_batched_tokens=default_on(k, default, self.device))

    def create_cache_config(self, bytes_per_block: int | None = None,
                            kv_budget_bytes: int | None = None, *,
                            disk_file_bytes: int | None = None,
                            max_model_len: int | None = None) -> CacheConfig:
        """Block counts from the explicit counts, else from the memory budgets:
        `kv_budget_bytes` (what the builder measured for --gpu-memory-utilization) or
        --kv-cache-memory-bytes, else --kv-cache-memory GiB (`disk_file_bytes`: one block
        file's size, for the disk tier's bound)."""
        knobs = self._knobs_for(CacheConfig)
        for name in ("kv_cache_memory", "swap_space", "kv_offload_gib", "kv_offload_ram_gib"):
            knobs[name] = check_knob(name, knobs[name], _CACHE[name][1])
        if self.num_kv_blocks is not None:
            num_blocks = check_knob("num_kv_blocks", self.num_kv_blocks, _CACHE["num_kv_blocks"][1])
        else:
            if not bytes_per_block:
                raise ConfigError("num_kv_blocks is needed when the block size in bytes is unknown")
            if self.kv_cache_memory_bytes is not None:
                budget, name = knobs["kv_cache_memory_bytes"], "kv_cache_memory_bytes"
                budget = check_knob(name, budget, _CACHE[name][1])
                what = f"kv_cache_memory_bytes {budget}"
            elif kv_budget_bytes is not None:
                budget, name = kv_budget_bytes, "gpu_memory_utilization"
                what = f"gpu_memory_utilization {self.gpu_memory_utilization} leaves " \
                       f"{budget} bytes, which"
            else:
                budget, name = self.kv_cache_memory * GiB, "kv_cache_memory"
                what = f"kv_cache_memory {self.kv_cache_memory} GiB"
            num_blocks = int(budget // bytes_per_block)
            if num_blocks < 1:
                raise ConfigError(f"{what} holds no KV block of {bytes_per_block} bytes", name)
        if self.num_swap_blocks is not None:
            num_swap = self.num_swap_blocks
        elif self.swap_space is not None:
            num_swap = int(self.swap_space * GiB // bytes_per_block) if bytes_per_block else 0
        else:
            num_swap = num_blocks if self.preemption_mode == "swap" else 0
        num_disk = self._disk_tier_blocks(disk_file_bytes or bytes_per_block)
        num_ram = self._ram_tier_blocks(bytes_per_block, num_blocks, num_disk, max_model_len)
        knobs.update(num_kv_blocks=num_blocks, num_swap_blocks=num_swap,
                     num_ram_tier_blocks=num_ram, num_disk_tier_blocks=num_disk)
        return CacheConfig(**knobs).validate()

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

    def create_load_config(self) -> LoadConfig:
        """The model's knobs checked (vLLM's load flags refused or resolved here), together
        with the other configs that only accept or refuse (LoRA, multimodal, observability),
        so a refused flag fails before anything loads."""
        for config in (LoRAConfig, MultiModalConfig, ObservabilityConfig):
            config(**self._knobs_for(config)).validate()
        return LoadConfig(**self._knobs_for(LoadConfig)).validate()

    @property
    def served_model_names(self) -> list[str]:
        """--served-model-name's names ([] when not given: the model's own name)."""
        names = self.served_model_name
        if names is None:
            return []
        return [names] if isinstance(names, str) else list(names)

    def create_parallel_config(self) -> ParallelConfig:
        return ParallelConfig(**self._knobs_for(ParallelConfig)).validate()

    def create_kernel_config(self) -> KernelConfig:
        return KernelConfig(**self._knobs_for(KernelConfig)).validate()

    # --- command line -------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Every engine knob's flag, one argument group per config."""
        defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
        add_config_arguments(parser, ENGINE_CONFIGS, defaults=defaults)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def replace(self, **changes: Any) -> "EngineArgs":
        return dataclasses.replace(self, **changes)
