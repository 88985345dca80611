"""Building an engine from EngineArgs: load the model, size the KV pool, make scheduler + runner.

    load_model -> kv_cache_config (blocks from the budget) -> Scheduler, ModelRunner
               -> KV tiers wired (the disk tier's setting key and the files it holds)

`build_engine_parts` returns the pieces; `LLMEngine.from_engine_args` wires them. Sizing is
its own step (`kv_cache_config`) so that memory planning (weights + activations + KV in one
budget) replaces that one function. torch is imported here, never at module import time, so
`iterserve.engine` stays importable without it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.scheduler import Scheduler
from iterserve.core.spec_decode import SpeculativeConfig
from iterserve.core.spec_decode.ngram import SyntheticAcceptance
from iterserve.engine import omp_policy
from iterserve.engine.tp_executor import TPExecutor
from iterserve.errors import ConfigError
from iterserve.model.startup import log_imports, phase

logger = logging.getLogger(__name__)


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
    pooler_config: Any = None        # model.pooler.PoolerConfig: served as an embedder


def kv_cache_config(args: Any, loaded: Any, max_model_len: int | None = None) -> CacheConfig:
    """The KV pool: `num_kv_blocks`, or as many blocks as the KV budget holds
    (--kv-cache-memory-bytes, --gpu-memory-utilization on CUDA, --kv-cache-memory); and the
    KV tiers' sizes (engine/args.py)."""
    from iterserve.model.runner import ModelRunner  # torch: the engine package imports none

    cfg = loaded.config
    bytes_per_block = ModelRunner.kv_cache_bytes_per_block(cfg, args.block_size)
    file_bytes = None
    if getattr(args, "kv_offload_dir", None):
        from iterserve.model.kv_tier_store import block_file_bytes  # torch: as above
        file_bytes = block_file_bytes(kv_setting_key(args, loaded), cfg, args.block_size)
    return args.create_cache_config(bytes_per_block, gpu_kv_budget(args, loaded),
                                    disk_file_bytes=file_bytes, max_model_len=max_model_len)


def kv_setting_key(args: Any, loaded: Any) -> str:
    """The disk tier's key: what makes one block's bytes (model/kv_tier_store.py)."""
    from iterserve.model.kv_tier_store import setting_key  # torch: the engine imports none

    cfg = loaded.config
    return setting_key(loaded, block_size=args.block_size,
                       kv_dtype=cfg.kv_cache_dtype or cfg.dtype,
                       kernel_activations=str(args.kernel_activations), device=args.device)


# What a step's activations may take beyond the weights, per token of the budget, in hidden
# sizes (residual, norms, q/k/v, attention output, and the MLP's gate/up/down at
# intermediate size), with the sampling rows' float32 logits on top; a deliberate
# over-estimate: vLLM measures it with a profiling pass, which the paged runner has no
# KV-free mode for.
_ACTIVATION_HIDDENS_PER_TOKEN = 8
_ACTIVATION_INTERMEDIATES_PER_TOKEN = 4


def gpu_kv_budget(args: Any, loaded: Any) -> int | None:
    """vLLM's --gpu-memory-utilization on a CUDA device: the KV bytes that leave this
    process within `utilization` x the GPU's memory, after the weights already loaded (all
    this process holds on the device now) and a reserve for one step's activations; None
    when the flag is unset, or overridden (--num-kv-blocks, --kv-cache-memory-bytes). On the
    CPU it has no meaning: one log line says so, and --kv-cache-memory sizes the cache."""
    util = args.gpu_memory_utilization
    if util is None or args.num_kv_blocks is not None or args.kv_cache_memory_bytes is not None:
        return None
    import torch

    device = torch.device(args.device)
    if device.type != "cuda":
        logger.warning("--gpu-memory-utilization has no effect on %s: the KV cache is sized "
                       "by --kv-cache-memory (GiB) or --kv-cache-memory-bytes", device.type)
        return None
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    cfg = loaded.config
    tokens = args.max_num_batched_tokens or 2048
    seqs = args.max_num_seqs or 256
    elem = torch.finfo(cfg.dtype).bits // 8
    activations = (tokens * elem * (_ACTIVATION_HIDDENS_PER_TOKEN * cfg.hidden_size
                                    + _ACTIVATION_INTERMEDIATES_PER_TOKEN
                                    * cfg.intermediate_size)
                   + seqs * cfg.vocab_size * 4 * 2)
    budget = min(int(total * util) - held, free) - activations
    logger.info("KV cache budget from --gpu-memory-utilization %.3g: %.2f GiB (device %.2f GiB, "
                "%.2f GiB free, this process holds %.2f GiB, activation reserve %.2f GiB)",
                util, budget / 2**30, total / 2**30, free / 2**30, held / 2**30,
                activations / 2**30)
    if budget <= 0:
        raise ConfigError(
            f"--gpu-memory-utilization {util}: {util:g} x {total / 2**30:.2f} GiB leaves no "
            f"room for a KV cache after the {held / 2**30:.2f} GiB this process holds and "
            f"{activations / 2**30:.2f} GiB for a step's activations ({free / 2**30:.2f} GiB "
            "of the device is free); raise it, or give --kv-cache-memory-bytes",
            "gpu_memory_utilization")
    return budget


def build_engine_parts(args: Any) -> EngineParts:
    log_imports()
    # The offline API reaches here without `iterserve serve`'s early call: apply the knob
    # before torch loads libgomp (a no-op when serve already set it).
    omp_policy.apply(getattr(args, "omp_wait_policy", "env"))
    with phase("torch"):
        import torch

        # the model layer (torch) loads here, once an engine is built, timed as "torch"
        from iterserve.model.loader import load_model
        from iterserve.model.runner import ModelRunner

    load = args.create_load_config()       # refused flags fail before anything loads
    check_weight_format(load)
    torch.manual_seed(args.seed)
    from iterserve.model import kernels  # torch: the engine package imports none
    kernel_knobs = args.create_kernel_config()
    kernels.configure(kernels.KernelConfig.from_knobs(kernel_knobs))
    parallel = args.create_parallel_config()
    if parallel.data_parallel_size > 1:
        # One LLMEngine is one replica: replicas are separate processes behind the server's
        # router (replicas/, Ray Serve), never something an in-process engine does quietly.
        raise ConfigError(
            f"data_parallel_size {parallel.data_parallel_size}: replicas run behind "
            "`iterserve serve --data-parallel-size N` (Ray Serve); an in-process engine "
            "(LLM, iterserve generate) is one replica", "data_parallel_size")
    if parallel.tensor_parallel_size > 1:
        if load.runner == "pooling" or load.pooling():
            raise ConfigError("--runner pooling does not run with tensor parallel yet",
                              "tensor_parallel_size")
        return _build_tensor_parallel(args)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device,
                        kv_cache_dtype=args.kv_cache_dtype, tokenizer=args.tokenizer,
                        hf_overrides=load.hf_overrides, pooling=load.pooling)
    pooler = _pooler(loaded, load)
    cfg = loaded.config
    sched_cfg = args.create_scheduler_config(cfg.max_position_embeddings)
    cache_cfg = kv_cache_config(args, loaded, sched_cfg.max_model_len)
    tiers = cache_cfg.num_ram_tier_blocks or cache_cfg.num_disk_tier_blocks
    with phase("runner"):      # memory plan, KV pools, kernel selection / build
        runner = ModelRunner(loaded, num_blocks=cache_cfg.num_kv_blocks,
                             block_size=cache_cfg.block_size,
                             num_swap_blocks=cache_cfg.num_swap_blocks,
                             num_tier_blocks=cache_cfg.num_ram_tier_blocks,
                             kv_offload_dir=args.kv_offload_dir if tiers else None,
                             kv_setting_key=kv_setting_key(args, loaded)
                             if args.kv_offload_dir else None, pooler=pooler,
                             # sliding-window layers hold only their window (chunked prefill)
                             max_tokens_per_step=sched_cfg.max_num_batched_tokens
                             if sched_cfg.enable_chunked_prefill else None,
                             max_num_seqs=sched_cfg.max_num_seqs,
                             prefix_caching=cache_cfg.enable_prefix_caching,
                             speculative=sched_cfg.speculative_config is not None,
                             threads=kernel_knobs.threads, adaptive_threads=True)
    _configure_speculation(runner, sched_cfg, args.seed, args, cache_cfg)
    parts = _parts(args, loaded, runner, sched_cfg, cache_cfg)
    parts.pooler_config = pooler.config if pooler is not None else None
    if tiers:
        _connect_tiers(parts.scheduler.block_manager, runner, args)
    return parts


def _pooler(loaded: Any, load: Any) -> Any:
    """--runner pooling: the model's Pooler (model/pooler.py), from its sentence-transformers
    config and --pooler-config; None for a generation model."""
    if not loaded.pooling:
        if load.pooler_config is not None:
            raise ConfigError("--pooler-config needs an embedding model (--runner pooling "
                              "or --convert embed)", "pooler_config")
        return None
    if loaded.config.model_type == "gpt2":
        raise ConfigError("--runner pooling serves the llama-family decoders (llama, "
                          "mistral, qwen2, qwen3) here, not gpt2", "runner")
    from iterserve.model.pooler import Pooler, read_pooler_config  # torch: as above
    cfg = read_pooler_config(loaded.path, loaded.hf_config, loaded.config.hidden_size,
                             load.pooler_config)
    logger.info("served as an embedding model: %s pooling, %s, %d dimensions%s (from %s)",
                cfg.pooling_type, "normalised" if cfg.normalize else "not normalised",
                cfg.hidden_size, ", Matryoshka" if cfg.is_matryoshka else "", cfg.source)
    return Pooler(cfg)


def _connect_tiers(bm: Any, runner: Any, args: Any) -> None:
    """Root the block manager's digest chains in the disk tier's key, index the block files
    a previous run (or another replica) left, and say in the memory plan what the tiers
    hold."""
    import logging

    from iterserve.model.runner import ModelRunner

    tiers, store = bm.tiers, runner.tier_store
    cfg = runner.config
    tiers.set_bytes_per_block(ModelRunner.kv_cache_bytes_per_block(cfg, bm.block_size))
    plan = {"ram": {"blocks": tiers.ram.num_slots if tiers.ram else 0,
                    "bytes": runner.memory_plan["kv_cache"]["ram_tier_bytes"]}}
    disk = store.disk
    if disk is not None and tiers.disk is not None:
        found = disk.scan()
        tiers.connect_disk(disk.key, found, probe=disk.exists)
        plan["disk"] = {"dir": str(disk.dir), "blocks": tiers.disk.capacity,
                        "bound_bytes": tiers.disk.capacity * disk.file_bytes,
                        "file_bytes": disk.file_bytes, "found_blocks": len(found)}
        logging.getLogger(__name__).info(
            "KV disk tier: %s, %d block files found, bound %d blocks (%.2f GiB)", disk.dir,
            len(found), tiers.disk.capacity, plan["disk"]["bound_bytes"] / (1 << 30))
    runner.memory_plan["kv_tiers"] = plan


def check_weight_format(load: Any) -> None:
    """--load-format safetensors|gguf and --quantization gguf say what the model file is:
    checked against the path (no model path: the bundled GGUF)."""
    path = load.model
    is_gguf = path is None or str(path).lower().endswith(".gguf")
    if load.load_format == "safetensors" and is_gguf:
        raise ConfigError(f"--load-format safetensors: the model {path or '(bundled)'} is a "
                          "GGUF file (use --load-format gguf or auto)", "load_format")
    if load.load_format == "gguf" and not is_gguf:
        raise ConfigError(f"--load-format gguf: the model {path} is not a .gguf file (use "
                          "--load-format safetensors or auto)", "load_format")
    if load.quantization == "gguf" and not is_gguf:
        raise ConfigError(f"--quantization gguf: the model {path} is not a .gguf file; its "
                          "weights are served as they are stored", "quantization")


def _configure_speculation(runner: Any, sched_cfg: SchedulerConfig, seed: int, args: Any,
                           cache_cfg: CacheConfig) -> None:
    """The executor's side of `speculative_config`: synthetic acceptance (benchmarks), or
    the draft model (model/draft.py) with a KV pool of the target's block count and size."""
    spec = SpeculativeConfig.parse(sched_cfg.speculative_config)
    if spec is not None and spec.method == "synthetic":
        runner.synthetic = SyntheticAcceptance(spec.acceptance_rates, seed)
    if spec is None or spec.method != "draft_model":
        return
    from iterserve.model.draft import DraftProposer  # torch, as the runner
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner

    try:
        draft = load_model(spec.model, dtype=args.dtype, device=args.device,
                           kv_cache_dtype=args.kv_cache_dtype)
    except (OSError, ValueError) as e:
        raise ConfigError(f"speculative_config.model: cannot load the draft model "
                          f"{spec.model!r}: {e}", "speculative_config") from None
    target = runner.config.vocab_size
    if draft.config.vocab_size != target:
        raise ConfigError(
            f"speculative_config.model: the draft model {spec.model!r} has a vocabulary of "
            f"{draft.config.vocab_size} tokens, the target {target}: a draft model must "
            "share the target's tokenizer", "speculative_config")
    with phase("draft runner"):
        draft_runner = ModelRunner(draft, num_blocks=cache_cfg.num_kv_blocks,
                                   block_size=cache_cfg.block_size,
                                   num_swap_blocks=cache_cfg.num_swap_blocks, speculative=True)
    runner.draft = DraftProposer(draft_runner)


def _build_tensor_parallel(args: Any) -> EngineParts:
    """-tp N: engine/tp_executor.py loads rank 0's slice here and spawns the other ranks."""
    if args.kv_offload_dir or args.kv_offload_ram_gib or args.num_ram_tier_blocks:
        raise ConfigError("the KV tiers (--kv-offload-dir, --kv-offload-ram-gib) do not run "
                          "with tensor parallel yet", "kv_offload_dir")
    spec = SpeculativeConfig.parse(getattr(args, "speculative_config", None))
    if spec is not None and spec.method == "draft_model":
        raise ConfigError("speculative_config: method draft_model does not run with tensor "
                          "parallel yet (the ranks hold no draft model); ngram, suffix and "
                          "synthetic do", "speculative_config")
    args = args.replace(num_ram_tier_blocks=0)      # (a GPU's default RAM tier included)
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
        model_name=(args.served_model_names or [loaded.name])[0],
        max_model_len=sched_cfg.max_model_len, vocab_size=cfg.vocab_size, eos_token_ids=eos,
        scheduler_config=sched_cfg, cache_config=cache_cfg, clock=clock)
