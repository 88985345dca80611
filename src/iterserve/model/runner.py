"""ModelRunner: one SchedulerOutput -> one forward pass -> sampled tokens.

The SchedulerOutput is data (core/scheduler_output.py): the runner keeps its own state per
request (`RequestState`: token ids, sampling params, block table), built from a request's
NewRequestData and updated from each step's diffs, and appends the token it samples. Per
step that costs O(scheduled requests + new blocks), never O(context).

The step's chunks are flattened into one token batch with no padding: decodes first (so
attention can batch them), then each prefill chunk. The K/V of every computed token is
written to the paged pool at the slots its request's block table names; logits are computed
only for the rows that sample (the last token of a chunk that reaches the request's end),
then one batched Sampler call picks the tokens from the runner's own rows. A request with
prompt_logprobs also gets the LM head over its prompt rows, chunk by chunk
(model/prompt_logprobs.py); they go back with its first sampled token. A step with
constrained sequences carries their token masks (`SchedulerOutput.grammar_bitmask`), applied
to those rows' logits before the sampler (which applies logit_bias, allowed_token_ids,
bad_words and min_tokens itself, from each row's params).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from iterserve.core.request import SamplingParams
from iterserve.core.scheduler_output import SampleResult, SchedulerOutput
from iterserve.model.attention import build_metadata
from iterserve.model.config import ModelConfig
from iterserve.model.kv_cache import PagedKVCache
from iterserve.model.memory import compute_paths

SamplerFn = Callable[[torch.Tensor, Sequence["RequestState"]], list[SampleResult]]


class RequestState:
    """The runner's copy of one request (a SamplingRow for the sampler)."""

    __slots__ = ("req_id", "prompt_token_ids", "output_token_ids", "token_ids",
                 "sampling_params", "block_ids", "prompt_lps")

    def __init__(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                 sampling_params: SamplingParams, block_ids) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids = list(output_token_ids)
        self.token_ids = self.prompt_token_ids + self.output_token_ids
        self.sampling_params = sampling_params
        self.block_ids = list(block_ids)
        # prompt_logprobs (api, model/prompt_logprobs.py): entries gathered chunk by chunk
        # until the first sample; None when not asked for or already sent (a resumed request).
        self.prompt_lps = [] if sampling_params.prompt_logprobs is not None \
            and not output_token_ids else None

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

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


def _window_blocks(config: ModelConfig, num_blocks: int, block_size: int, num_swap_blocks: int,
                   max_tokens: int | None, max_num_seqs: int | None, prefix_caching: bool):
    """core.sliding_window.SlidingWindowBlocks for a model whose sliding layers can hold
    fewer blocks than its full ones, or None (no such layers, swap space, prefix caching, no
    bound on a request's tokens per step, or no saving at this pool size)."""
    from iterserve.core.sliding_window import SlidingWindowBlocks, blocks_per_request
    from iterserve.model.config import FULL, SLIDING
    window = config.layer_window
    if not window or not max_tokens or num_swap_blocks or prefix_caching \
            or not {FULL, SLIDING} <= set(config.layer_types):
        return None
    cap = blocks_per_request(window, block_size, max_tokens)
    pool = min(num_blocks, (max_num_seqs or num_blocks) * cap)
    if pool < cap or pool >= num_blocks:
        return None
    return SlidingWindowBlocks(window, block_size, max_tokens, pool)


class ModelRunner:
    def __init__(self, loaded, *, num_blocks: int, block_size: int,
                 num_swap_blocks: int = 0, sampler: SamplerFn | None = None,
                 pack_weights: str | bool | None = "default",
                 quant_kernels: bool | str = "default",
                 native_kernels: bool | str = "default",
                 max_tokens_per_step: int | None = None, max_num_seqs: int | None = None,
                 prefix_caching: bool = False) -> None:
        """`max_tokens_per_step` (the scheduler's token budget with chunked prefill) turns on
        window pools for sliding-window layers (core/sliding_window.py): without swap space
        or prefix caching, those layers hold only their window's blocks."""
        self.loaded = loaded
        self.model = loaded.model
        self.config: ModelConfig = loaded.config
        self.device = next(self.model.parameters()).device
        self.block_size = block_size
        kv_dtype = self.config.kv_cache_dtype or self.config.dtype
        self.window_blocks = _window_blocks(self.config, num_blocks, block_size, num_swap_blocks,
                                            max_tokens_per_step, max_num_seqs, prefix_caching)
        layer_blocks = None
        if self.window_blocks is not None:
            w = self.window_blocks
            layer_blocks = [w.num_blocks if win == w.window else num_blocks
                            for win in self.config.layer_windows()]
        # Say what this process will hold and refuse, before allocating, what cannot fit.
        from iterserve.model.memory import check_memory_plan, log_memory_plan, plan_memory
        per_layer = PagedKVCache.bytes_per_block(self.config, block_size, kv_dtype) \
            // self.config.num_layers
        self.memory_plan = plan_memory(
            loaded, num_blocks=num_blocks, block_size=block_size,
            num_swap_blocks=num_swap_blocks, kv_dtype=kv_dtype,
            kv_bytes=None if layer_blocks is None else per_layer * sum(layer_blocks))
        self._window_stats = None
        if self.window_blocks is not None:
            self._window_stats = self.window_blocks.stats()
            full = [i for i, n in enumerate(layer_blocks) if n == num_blocks
                    and self.config.window_of(i) != self.window_blocks.window]
            self.memory_plan["kv_cache"]["layer_groups"] = [
                {"window": None, "layers": full, "num_blocks": num_blocks},
                {"layers": [i for i in range(len(layer_blocks)) if i not in full],
                 **self._window_stats}]
            self._window_stats = self.memory_plan["kv_cache"]["layer_groups"][1]
        check_memory_plan(self.memory_plan)
        self.kv_cache = PagedKVCache(self.config, num_blocks=num_blocks, block_size=block_size,
                                     num_swap_blocks=num_swap_blocks, dtype=kv_dtype,
                                     device=self.device, layer_blocks=layer_blocks)
        if sampler is None:
            from iterserve.model.sampler import Sampler
            sampler = Sampler()
        self.sampler = sampler
        self.requests: dict[str, RequestState] = {}
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
        # The native attention reads float32 or f16 pools (f16: half the KV bytes per step;
        # kernels/decode_attention.c); a bf16 pool keeps the torch path.
        if on and self.device.type == "cpu" and self.config.dtype == torch.float32 \
                and kv_dtype in (torch.float32, torch.float16) and self.config.head_dim % 8 == 0:
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
    def update_states(self, output: SchedulerOutput) -> None:
        """Apply the step's data to the per-request states (finished / preempted dropped,
        new ones built, cached ones' new blocks and resumed tables applied)."""
        states = self.requests
        wb = self.window_blocks
        for rid in output.finished_req_ids:
            states.pop(rid, None)
            if wb is not None:
                wb.release(rid)
        for rid in output.preempted_req_ids:
            states.pop(rid, None)
            if wb is not None:
                wb.release(rid)
        for d in output.scheduled_new_reqs:
            if wb is not None:
                if not d.num_computed_tokens:
                    wb.release(d.req_id)       # a request starting over starts its window too
                elif not wb.holds(d.req_id):
                    raise ValueError(f"request {d.req_id!r} starts at token "
                                     f"{d.num_computed_tokens} but its sliding-window layers "
                                     "hold no blocks (prefix caching keeps full tables)")
            states[d.req_id] = RequestState(d.req_id, d.prompt_token_ids, d.output_token_ids,
                                            d.sampling_params, d.block_ids)
        for d in output.scheduled_cached_reqs:
            st = states.get(d.req_id)
            if st is None:
                raise ValueError(f"step {output.step}: cached data for request "
                                 f"{d.req_id!r}, which the runner does not hold")
            if d.resumed_from_preemption:
                st.block_ids = list(d.new_block_ids)
            elif d.new_block_ids:
                st.block_ids.extend(d.new_block_ids)

    def execute(self, output: SchedulerOutput) -> dict[str, SampleResult]:
        logits, sampling = self._run(output)
        if not sampling:
            return {}
        if output.grammar_bitmask is not None:     # structured outputs: forbidden ids -> -inf
            with torch.inference_mode():           # the logits are inference tensors
                output.grammar_bitmask.apply(logits, [st.req_id for st in sampling])
        results = self.sampler(logits, sampling)
        for st, res in zip(sampling, results):
            st.append(res.token_id)
            if st.prompt_lps is not None:          # prompt_logprobs go with the first token
                res.prompt_logprobs, st.prompt_lps = st.prompt_lps, None
        return {st.req_id: res for st, res in zip(sampling, results)}

    def compute_logits(self, output: SchedulerOutput) -> torch.Tensor:
        """float32 logits [N, vocab] of the sampling requests, in num_scheduled_tokens order
        (applies the step's data but samples nothing)."""
        logits, _ = self._run(output)
        return logits

    def _run(self, output: SchedulerOutput) -> tuple[torch.Tensor, list[RequestState]]:
        self.update_states(output)
        self.kv_cache.swap_out(output.blocks_to_swap_out)
        self.kv_cache.swap_in(output.blocks_to_swap_in)
        if not output.num_scheduled_tokens:
            return torch.empty(0, self.config.vocab_size), []
        states = self.requests
        chunks: list[tuple[RequestState, int, int]] = []     # (state, start, num_tokens)
        starts = {d.req_id: d.num_computed_tokens for d in output.scheduled_new_reqs}
        for d in output.scheduled_cached_reqs:
            starts[d.req_id] = d.num_computed_tokens
        for rid, n in output.num_scheduled_tokens.items():
            st = states.get(rid)
            start = starts.get(rid)
            if st is None or start is None:
                raise ValueError(f"step {output.step}: request {rid!r} is scheduled but "
                                 "the runner has no data for it")
            if n < 1 or start < 0 or start + n > len(st.token_ids):
                raise ValueError(
                    f"chunk of request {rid!r} asks for tokens "
                    f"[{start}, {start + n}) of a {len(st.token_ids)}-token request")
            chunks.append((st, start, n))
        # Decodes first (batched attention), then prefill chunks; stable within each group.
        order = sorted(range(len(chunks)), key=lambda i: chunks[i][2] != 1)
        ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}
        spans = []
        for i in order:
            st, start, n = chunks[i]
            ids.extend(st.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            last_row[i] = len(ids) - 1
            spans.append((start, n, st.block_ids))
        meta = build_metadata(spans, self.block_size, self.config.sliding_window, self.device,
                              self.config.dtype, decode_kernel=self.decode_kernel)
        if self.window_blocks is not None:      # the sliding layers read their window pools
            wb = self.window_blocks
            window_spans = [(start, n, wb.table(chunks[i][0].req_id, start, n))
                            for i, (start, n, _) in zip(order, spans)]
            meta.variants[wb.window] = build_metadata(
                window_spans, self.block_size, wb.window, self.device, self.config.dtype,
                decode_kernel=self.decode_kernel)
            self._window_stats.update(wb.stats())
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, pos, max(positions), self.kv_cache, meta)
        for i in order:                            # prompt_logprobs: the chunk's prompt rows
            st, start, n = chunks[i]
            if st.prompt_lps is not None:
                self._prompt_logprobs(st, start, n, hidden, last_row[i] - n + 1)
        sample_idx = [i for i, (st, start, n) in enumerate(chunks)
                      if start + n >= len(st.token_ids)]
        if not sample_idx:
            return torch.empty(0, self.config.vocab_size), []
        rows = [last_row[i] for i in sample_idx]
        sel = hidden.index_select(0, torch.tensor(rows, device=self.device))
        return self.model.logits(sel), [chunks[i][0] for i in sample_idx]

    def _prompt_logprobs(self, st: RequestState, start: int, n: int, hidden: torch.Tensor,
                         first_row: int) -> None:
        """Append the entries of the chunk's rows that predict a prompt token (position p
        predicts token p + 1; run on every TP rank alike, as the LM head gathers)."""
        from iterserve.model.prompt_logprobs import chunk_prompt_logprobs
        end = min(start + n, len(st.prompt_token_ids) - 1)
        if end <= start:
            return
        st.prompt_lps.extend(chunk_prompt_logprobs(
            self.model.logits, hidden[first_row:first_row + end - start],
            st.prompt_token_ids[start + 1:end + 1], st.sampling_params.prompt_logprobs))
