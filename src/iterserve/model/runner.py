"""ModelRunner: one SchedulerOutput -> one forward pass -> sampled tokens.

The step's chunks are flattened into one token batch with no padding: decodes first (so
attention can batch them), then each prefill chunk. The K/V of every computed token is
written to the paged pool at the slots its chunk's block table names; logits are computed
only for the rows that sample (the last token of a chunk that reaches the request's end),
then one batched Sampler call picks the tokens.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from iterserve.core.request import Request
from iterserve.core.scheduler_output import SampleResult, ScheduledChunk, SchedulerOutput
from iterserve.model.attention import build_metadata
from iterserve.model.config import ModelConfig
from iterserve.model.kv_cache import PagedKVCache
from iterserve.model.memory import compute_paths

SamplerFn = Callable[[torch.Tensor, Sequence[Request]], list[SampleResult]]

# Prepacked weights (layers.Linear) cost one extra copy of a weight, so only dense float32
# weights (a float32 checkpoint's own dtype) are packed; encoded ones never are.
# "onednn" by default: measured side by side by benchmarks/bench_decode.py on this machine
# (an AMD EPYC VM, where MKL's sgemm is slow at decode row counts).
# None means plain F.linear (always the case on CUDA and for non-float32 weights).
PACKING_DEFAULT: str | None = "onednn"
# Decode steps through the native GEMM over encoded blocks where the type has one
# (layers.Linear.use_quant); False sends every encoded GEMM through the reference tiles.
QUANT_DEFAULT = True
# Decode attention and the elementwise ops (RMSNorm, SiLU x up, RoPE) through the native kernels
# (kernels/decode_attention.c, elementwise.c) on CPU float32; with the block kernel also on,
# small decode-only steps run all layers in one native call (kernels/decode_layers.c).
NATIVE_KERNELS_DEFAULT = True


class ModelRunner:
    def __init__(self, loaded, *, num_blocks: int, block_size: int,
                 num_swap_blocks: int = 0, sampler: SamplerFn | None = None,
                 pack_weights: str | bool | None = "default",
                 quant_kernels: bool | str = "default",
                 native_kernels: bool | str = "default") -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.config: ModelConfig = loaded.config
        self.device = next(self.model.parameters()).device
        self.block_size = block_size
        kv_dtype = self.config.kv_cache_dtype or self.config.dtype
        # Say what this process will hold and refuse, before allocating, what cannot fit.
        from iterserve.model.memory import check_memory_plan, log_memory_plan, plan_memory
        self.memory_plan = plan_memory(loaded, num_blocks=num_blocks, block_size=block_size,
                                       num_swap_blocks=num_swap_blocks, kv_dtype=kv_dtype)
        check_memory_plan(self.memory_plan)
        self.kv_cache = PagedKVCache(self.config, num_blocks=num_blocks, block_size=block_size,
                                     num_swap_blocks=num_swap_blocks, dtype=kv_dtype,
                                     device=self.device)
        if sampler is None:
            from iterserve.model.sampler import Sampler
            sampler = Sampler()
        self.sampler = sampler
        # Packing is a property of the model's Linear modules: set (or clear) it every time.
        mode = PACKING_DEFAULT if pack_weights == "default" else pack_weights
        self.packed = self.model.pack_linears(mode)
        use_quant = QUANT_DEFAULT if quant_kernels == "default" else bool(quant_kernels)
        self.quantized = self.model.use_quant(use_quant) if hasattr(self.model, "use_quant") \
            else False
        on = NATIVE_KERNELS_DEFAULT if native_kernels == "default" else bool(native_kernels)
        self.native_ops = self.model.use_native_ops(on) if hasattr(self.model, "use_native_ops") \
            else False
        self.decode_kernel = None
        if on and self.device.type == "cpu" and self.config.dtype == torch.float32 \
                and kv_dtype == torch.float32 and self.config.head_dim % 8 == 0:
            from iterserve.model import kernels
            self.decode_kernel = kernels.decode_attention()
        # Small decode-only steps: every layer in one native call (llama.use_fused_decode).
        # The model checks the rest (block kernel and native ops in use, architecture).
        self.fused_decode = self.model.use_fused_decode(self.decode_kernel is not None) \
            if hasattr(self.model, "use_fused_decode") else False
        self.memory_plan.update(compute_paths(self.model), fused_decode=bool(self.fused_decode))
        log_memory_plan(self.memory_plan)

    @staticmethod
    def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype=None) -> int:
        """Bytes of one KV block in `dtype`, else the KV cache's dtype (`--kv-cache-dtype`)."""
        return PagedKVCache.bytes_per_block(config, block_size,
                                            dtype or config.kv_cache_dtype or config.dtype)

    # --- one step ------------------------------------------------------------------------
    def execute(self, output: SchedulerOutput) -> dict[str, SampleResult]:
        logits, sampling = self._run(output)
        if not sampling:
            return {}
        requests = [c.request for c in sampling]
        results = self.sampler(logits, requests)
        return {r.request_id: res for r, res in zip(requests, results)}

    def compute_logits(self, output: SchedulerOutput) -> torch.Tensor:
        """float32 logits [N, vocab] of the sampling chunks, in output.chunks order."""
        logits, _ = self._run(output)
        return logits

    def _run(self, output: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        self.kv_cache.swap_out(output.blocks_to_swap_out)
        self.kv_cache.swap_in(output.blocks_to_swap_in)
        if not output.chunks:
            return torch.empty(0, self.config.vocab_size), []
        for c in output.chunks:
            if c.num_tokens < 1 or c.start < 0 or c.start + c.num_tokens > c.request.num_tokens:
                raise ValueError(
                    f"chunk of request {c.request.request_id!r} asks for tokens "
                    f"[{c.start}, {c.start + c.num_tokens}) of a {c.request.num_tokens}-token request")
        # Decodes first (batched attention), then prefill chunks; stable within each group.
        order = sorted(range(len(output.chunks)), key=lambda i: output.chunks[i].num_tokens != 1)
        chunks = [output.chunks[i] for i in order]
        ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}
        for i, c in zip(order, chunks):
            ids.extend(c.token_ids)
            positions.extend(range(c.start, c.start + c.num_tokens))
            last_row[i] = len(ids) - 1
        meta = build_metadata([(c.start, c.num_tokens, c.block_ids) for c in chunks],
                              self.block_size, self.config.sliding_window, self.device,
                              self.config.dtype, decode_kernel=self.decode_kernel)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, pos, max(positions), self.kv_cache, meta)
        sampling = [c for c in output.chunks if c.sample]
        rows = [last_row[i] for i, c in enumerate(output.chunks) if c.sample]
        if not rows:
            return torch.empty(0, self.config.vocab_size), []
        sel = hidden.index_select(0, torch.tensor(rows, device=self.device))
        return self.model.logits(sel), sampling
