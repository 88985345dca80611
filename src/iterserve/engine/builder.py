"""Building an engine from EngineArgs: load the model, size the KV pool, make scheduler + runner.

    load_model -> kv_cache_config (blocks from the budget) -> Scheduler, ModelRunner

`build_engine_parts` returns the pieces; `LLMEngine.from_engine_args` wires them. Sizing is
its own step (`kv_cache_config`) so that memory planning (weights + activations + KV in one
budget) replaces that one function. torch is imported here, never at module import time, so
`iterserve.engine` stays importable without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from iterserve.core.config import CacheConfig, ConfigError, SchedulerConfig
from iterserve.core.scheduler import Scheduler


@dataclass(eq=False)
class EngineParts:
    """Everything LLMEngine is made of, built and sized."""

    scheduler: Scheduler
    executor: Any                    # model.runner.ModelRunner
    tokenizer: Any
    loaded_model: Any                # model.loader's LoadedModel (config, tokenizer, name)
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: set[int]
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    clock: Callable[[], float]


def kv_cache_config(args: Any, loaded: Any) -> CacheConfig:
    """The KV pool: `num_kv_blocks`, or as many blocks as `kv_cache_memory` GiB holds."""
    from iterserve.model.runner import ModelRunner

    cfg = loaded.config
    bytes_per_block = ModelRunner.kv_cache_bytes_per_block(cfg, args.block_size)
    return args.create_cache_config(bytes_per_block)


def build_engine_parts(args: Any) -> EngineParts:
    from iterserve.engine import omp_policy
    from iterserve.model.startup import log_imports, phase
    log_imports()
    # The offline API reaches here without `iterserve serve`'s early call: apply the knob
    # before torch loads libgomp (a no-op when serve already set it).
    omp_policy.apply(getattr(args, "omp_wait_policy", "env"))
    with phase("torch"):
        import torch

        from iterserve.model.loader import load_model
        from iterserve.model.runner import ModelRunner

    torch.manual_seed(args.seed)
    _configure_kernels(args)
    parallel = args.create_parallel_config()
    if parallel.data_parallel_size > 1:
        # One LLMEngine is one replica: replicas are separate processes behind the server's
        # router (replicas/, Ray Serve), never something an in-process engine does quietly.
        raise ConfigError(
            f"data_parallel_size {parallel.data_parallel_size}: replicas run behind "
            "`iterserve serve --data-parallel-size N` (Ray Serve); an in-process engine "
            "(LLM, iterserve generate) is one replica", "data_parallel_size")
    if parallel.tensor_parallel_size > 1:
        return _build_tensor_parallel(args)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device,
                        kv_cache_dtype=args.kv_cache_dtype, tokenizer=args.tokenizer)
    cfg = loaded.config
    sched_cfg = args.create_scheduler_config(cfg.max_position_embeddings)
    cache_cfg = kv_cache_config(args, loaded)
    with phase("runner"):      # memory plan, KV pools, kernel selection / build
        runner = ModelRunner(loaded, num_blocks=cache_cfg.num_kv_blocks,
                             block_size=cache_cfg.block_size,
                             num_swap_blocks=cache_cfg.num_swap_blocks,
                             # sliding-window layers hold only their window (chunked prefill)
                             max_tokens_per_step=sched_cfg.max_num_batched_tokens
                             if sched_cfg.enable_chunked_prefill else None,
                             max_num_seqs=sched_cfg.max_num_seqs,
                             prefix_caching=cache_cfg.enable_prefix_caching)
    return _parts(args, loaded, runner, sched_cfg, cache_cfg)


def _configure_kernels(args: Any) -> None:
    """The process-wide kernel knobs (core/config.py KernelConfig), before the model loads."""
    from iterserve.model import kernels
    kernels.configure_activations(args.create_kernel_config().kernel_activations.value)


def _build_tensor_parallel(args: Any) -> EngineParts:
    """-tp N: engine/tp_executor.py loads rank 0's slice here and spawns the other ranks."""
    from iterserve.engine.tp_executor import TPExecutor

    executor = TPExecutor(args, kv_cache_config)
    try:
        sched_cfg = args.create_scheduler_config(executor.config.max_position_embeddings)
    except BaseException:
        executor.shutdown()
        raise
    return _parts(args, executor.loaded, executor, sched_cfg, executor.cache_config)


def _parts(args: Any, loaded: Any, runner: Any, sched_cfg: SchedulerConfig,
           cache_cfg: CacheConfig) -> EngineParts:
    cfg = loaded.config
    clock = time.monotonic
    scheduler = Scheduler(sched_cfg, cache_cfg, clock=clock)
    eos = set(cfg.eos_token_ids or ()) | set(getattr(loaded.tokenizer, "eos_token_ids", ()) or ())
    return EngineParts(
        scheduler=scheduler, executor=runner, tokenizer=loaded.tokenizer, loaded_model=loaded,
        model_name=args.served_model_name or loaded.name,
        max_model_len=sched_cfg.max_model_len, vocab_size=cfg.vocab_size, eos_token_ids=eos,
        scheduler_config=sched_cfg, cache_config=cache_cfg, clock=clock)
