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

KV tiers (`SchedulerOutput.kv_tiers`, model/kv_tier_store.py): their saves and disk reads
run before the step's swaps, their RAM loads after them, all before the forward pass. A
load whose slot turned out bad (a failed disk read) leaves its block without data; a chunk
whose context holds such a block starts at it instead, so those tokens are recomputed in
this very forward pass (every layer writes the step's K/V before any chunk reads the
pool, so a request sharing the block in the same step reads the recomputed values).

Speculative decoding: a request verifying k drafts (`scheduled_spec_decode_tokens`) is
computed as k + 1 decode rows (its last token and the drafts, at positions start..start+k,
each attending to the context up to itself: the K/V of the whole step is written before
attention reads it), so each verified position gets exactly the arithmetic a plain decode
step would give it, and small steps keep the fused decode path. Every one of its rows is
sampled; model/rejection_sampler.py keeps the drafts up to the first disagreement. The
runner then appends the accepted drafts and its own token to its copy. With a draft model
(`draft`, model/draft.py) the scheduler's drafts are placeholders, filled here by the draft's
greedy tokens before the step is built.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from iterserve.core.request import SamplingParams
from iterserve.core.scheduler_output import (PoolingOutput, SampleResult, SchedulerOutput,
                                             verify_row_id)
from iterserve.core.spec_decode.ngram import DRAFT_PLACEHOLDER
from iterserve.model import kernels
from iterserve.model.attention import build_metadata
from iterserve.model.config import ModelConfig
from iterserve.model.contention import ThreadAdapter
from iterserve.model.kv_cache import PagedKVCache
from iterserve.model.kv_tier_store import DiskStore, KVTierStore
from iterserve.model.memory import check_memory_plan, compute_paths, log_memory_plan, plan_memory
from iterserve.model.pooler import Pooler, PoolState
from iterserve.model.prompt_logprobs import chunk_prompt_logprobs
from iterserve.model.rejection_sampler import verify
from iterserve.model.sampler import Sampler

SamplerFn = Callable[[torch.Tensor, Sequence["RequestState"]], list[SampleResult]]


class RequestState:
    """The runner's copy of one request (a SamplingRow for the sampler)."""

    __slots__ = ("req_id", "prompt_token_ids", "output_token_ids", "token_ids",
                 "sampling_params", "block_ids", "prompt_lps", "pooling_params", "pool")

    def __init__(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                 sampling_params: SamplingParams, block_ids, pooling_params=None) -> None:
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
        # A pooling request (model/pooler.py): what its pooler kept of the chunks so far.
        self.pooling_params = pooling_params
        self.pool = PoolState() if pooling_params is not None else None

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
                   max_tokens: int | None, max_num_seqs: int | None, prefix_caching: bool,
                   tiers: bool = False, speculative: bool = False):
    """core.sliding_window.SlidingWindowBlocks for a model whose sliding layers can hold
    fewer blocks than its full ones, or None (no such layers, swap space, prefix caching, KV
    tiers, speculative decoding, no bound on a request's tokens per step, or no saving at this pool
    size). Prefix caching and the tiers keep a block's KV for every layer, and rejected drafts
    roll block tables back: with them every layer holds the full pool (the sliding layers
    still read only their window)."""
    from iterserve.core.sliding_window import SlidingWindowBlocks, blocks_per_request
    from iterserve.model.config import FULL, SLIDING
    window = config.layer_window
    if not window or not max_tokens or num_swap_blocks or prefix_caching or tiers or speculative \
            or not {FULL, SLIDING} <= set(config.layer_types):
        return None
    cap = blocks_per_request(window, block_size, max_tokens)
    pool = min(num_blocks, (max_num_seqs or num_blocks) * cap)
    if pool < cap or pool >= num_blocks:
        return None
    return SlidingWindowBlocks(window, block_size, max_tokens, pool)


class _TierReport:
    """What the runner saw of the KV tiers since the last `take_kv_feedback`."""

    __slots__ = ("ram_load", "compute_s", "compute_tokens", "invalid")

    # A forward pass with this many prompt tokens prices a recompute (a smaller step costs
    # per token what its decodes cost).
    MIN_PREFILL_TOKENS = 32

    def __init__(self) -> None:
        self.ram_load = (0.0, 0)
        self.compute_s, self.compute_tokens = 0.0, 0
        self.invalid: set[int] = set()

    def loaded(self, ops, bad: set[int], ram_load: tuple[float, int]) -> None:
        """The loads are done: only the bad ones' blocks may still be invalid."""
        self.invalid.difference_update(b for _, b in ops.ram_loads if b not in bad)
        s, n = self.ram_load
        self.ram_load = (s + ram_load[0], n + ram_load[1])

    def timed(self, t0: float, output: SchedulerOutput) -> None:
        tokens = output.num_batched_tokens
        if tokens - output.num_seqs >= self.MIN_PREFILL_TOKENS:
            self.compute_s += time.perf_counter() - t0
            self.compute_tokens += tokens


class ModelRunner:
    def __init__(self, loaded, *, num_blocks: int, block_size: int,
                 num_swap_blocks: int = 0, sampler: SamplerFn | None = None,
                 pack_weights: str | bool | None = "default",
                 quant_kernels: bool | str = "default",
                 native_kernels: bool | str = "default",
                 num_tier_blocks: int = 0, kv_offload_dir: str | None = None,
                 kv_setting_key: str | None = None, pooler: Pooler | None = None,
                 max_tokens_per_step: int | None = None, max_num_seqs: int | None = None,
                 prefix_caching: bool = False, speculative: bool = False,
                 threads: int | None = None, adaptive_threads: bool = False) -> None:
        """`max_tokens_per_step` (the scheduler's token budget with chunked prefill) turns on
        window pools for sliding-window layers (core/sliding_window.py): without swap space,
        prefix caching, KV tiers or speculative decoding, those layers hold only their
        window's blocks."""
        self.loaded = loaded
        # --runner pooling: pooling requests' vectors (model/pooler.py); None: generate only.
        self.pooler = pooler
        self._pooled: dict[str, PoolingOutput] = {}
        self.model = loaded.model
        self.config: ModelConfig = loaded.config
        self.device = next(self.model.parameters()).device
        self.block_size = block_size
        kv_dtype = self.config.kv_cache_dtype or self.config.dtype
        self.window_blocks = _window_blocks(self.config, num_blocks, block_size, num_swap_blocks,
                                            max_tokens_per_step, max_num_seqs, prefix_caching,
                                            tiers=bool(num_tier_blocks or kv_offload_dir),
                                            speculative=speculative)
        layer_blocks = None
        if self.window_blocks is not None:
            w = self.window_blocks
            layer_blocks = [w.num_blocks if win == w.window else num_blocks
                            for win in self.config.layer_windows()]
        # Say what this process will hold and refuse, before allocating, what cannot fit.
        per_layer = PagedKVCache.bytes_per_block(self.config, block_size, kv_dtype) \
            // self.config.num_layers
        self.memory_plan = plan_memory(
            loaded, num_blocks=num_blocks, block_size=block_size,
            num_swap_blocks=num_swap_blocks, kv_dtype=kv_dtype, num_tier_blocks=num_tier_blocks,
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
                                     device=self.device, num_tier_blocks=num_tier_blocks,
                                     layer_blocks=layer_blocks)
        self.tier_store = None
        if num_tier_blocks or kv_offload_dir:
            disk = None
            if kv_offload_dir:
                disk = DiskStore(kv_offload_dir, kv_setting_key, self.kv_cache.block_shape,
                                 kv_dtype)
            self.tier_store = KVTierStore(self.kv_cache, disk)
        self._tier_report = _TierReport()
        if sampler is None:
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
        self.prefill_kernel = False
        # The native attention reads float32 or f16 pools (f16: half the KV bytes per step;
        # kernels/decode_attention.c); bf16 pools only the prefill kernel, which then takes
        # the decodes too (attention.build_metadata). One order of operations in both keeps
        # a sequence's logits independent of the batch.
        if on and self.device.type == "cpu" and self.config.dtype == torch.float32 \
                and kv_dtype in (torch.float32, torch.float16, torch.bfloat16) \
                and self.config.head_dim % 8 == 0:
            self.prefill_kernel = kernels.available()
            if kv_dtype != torch.bfloat16:
                self.decode_kernel = kernels.decode_attention()
        # Small decode-only steps: every layer in one native call (llama.use_fused_decode).
        # The model checks the rest (block kernel and native ops in use, architecture). Not
        # with window pools: the fused call reads one pool and one block table for all layers.
        self.fused_decode = self.model.use_fused_decode(
            self.decode_kernel is not None and self.window_blocks is None) \
            if hasattr(self.model, "use_fused_decode") else False
        self.memory_plan.update(compute_paths(self.model), fused_decode=bool(self.fused_decode))
        log_memory_plan(self.memory_plan)
        # The compute team's size (model/contention.py): `threads` fixes it; else, on CPU
        # with `adaptive_threads` (the engine's default), measured per step, at most what
        # torch starts with; else torch's as it is. OpenMP keeps the size per
        # thread, so `execute` applies it on the thread that steps.
        self.thread_adapter = None
        if threads is not None:
            torch.set_num_threads(threads)
            self.thread_adapter = ThreadAdapter(threads, fixed=threads)
        elif adaptive_threads and self.device.type == "cpu":
            self.thread_adapter = ThreadAdapter(torch.get_num_threads())

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
        for rid, keep in output.truncated_block_tables.items():   # rejected drafts' blocks
            st = states.get(rid)
            if st is not None:
                del st.block_ids[keep:]
        for d in output.scheduled_new_reqs:
            if d.pooling_params is not None and self.pooler is None:
                raise ValueError(f"request {d.req_id!r} asks for pooling, which this runner "
                                 "was not built for (--runner pooling)")
            if wb is not None:
                if not d.num_computed_tokens:
                    wb.release(d.req_id)       # a request starting over starts its window too
                elif not wb.holds(d.req_id):
                    raise ValueError(f"request {d.req_id!r} starts at token "
                                     f"{d.num_computed_tokens} but its sliding-window layers "
                                     "hold no blocks (prefix caching keeps full tables)")
            states[d.req_id] = RequestState(d.req_id, d.prompt_token_ids, d.output_token_ids,
                                            d.sampling_params, d.block_ids, d.pooling_params)
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
        adapter = self.thread_adapter
        if adapter is not None and output.num_batched_tokens:
            n = adapter.for_step(output.num_batched_tokens)
            if n != torch.get_num_threads():
                torch.set_num_threads(n)
        t0 = time.perf_counter()
        try:
            return self._execute(output, t0)
        finally:
            if adapter is not None and output.num_batched_tokens:
                adapter.observe(time.perf_counter() - t0, output.num_batched_tokens)

    def _execute(self, output: SchedulerOutput, t0: float) -> dict[str, SampleResult]:
        logits, sampling, drafts = self._run(output)
        pooled, self._pooled = self._pooled, {}
        if not sampling:
            self._tier_report.timed(t0, output)
            return pooled
        if output.grammar_bitmask is not None:     # structured outputs: forbidden ids -> -inf
            with torch.inference_mode():           # the logits are inference tensors
                output.grammar_bitmask.apply(logits, self._row_ids(sampling, drafts))
                deferred = getattr(output.grammar_bitmask, "deferred", None)
                if deferred and not drafts:   # masks not ready: these sample nothing (masks.py)
                    keep = [i for i, st in enumerate(sampling) if st.req_id not in deferred]
                    if not keep:
                        self._tier_report.timed(t0, output)
                        return {}
                    logits = logits[keep]
                    sampling = [sampling[i] for i in keep]
        if drafts:
            results = verify(self.sampler, logits, sampling, drafts, self.synthetic)
            if self.draft is not None:
                for st, res in zip(sampling, results):
                    d = drafts.get(st.req_id)
                    if d:
                        self.draft.accepted(st.req_id, len(st.token_ids) - 1, len(d),
                                            len(res.verified or ()))
        else:
            results = self.sampler(logits, sampling)
        for st, res in zip(sampling, results):
            st.append(res.token_id)
            if res.verified:
                for r in res.verified:
                    st.append(r.token_id)
            if st.prompt_lps is not None:          # prompt_logprobs go with the first token
                res.prompt_logprobs, st.prompt_lps = st.prompt_lps, None
        self._tier_report.timed(t0, output)
        out = {st.req_id: res for st, res in zip(sampling, results)}
        if pooled:
            out.update(pooled)
        return out

    def take_kv_feedback(self):
        """The KV tiers' report on the steps since the last call (core KVTierFeedback), or
        None: failed reads and writes, blocks a failed load left wrong, measured costs."""
        if self.tier_store is None:
            return None
        r, self._tier_report = self._tier_report, _TierReport()
        return self.tier_store.feedback(ram_load=r.ram_load, compute_s=r.compute_s,
                                        compute_tokens=r.compute_tokens,
                                        invalid_blocks=r.invalid)

    def shutdown(self) -> None:
        """Write what the disk tier still has queued, then stop its threads."""
        if self.tier_store is not None:
            self.tier_store.close()

    # Set by the engine for `synthetic` speculative decoding (rejection_sampler.py).
    synthetic = None
    # Set by the engine for `draft_model` speculative decoding (model/draft.py).
    draft = None

    def _metadata(self, spans, window):
        """Attention metadata for `spans` (start, tokens, block table) with this runner's
        kernels, for layers of sliding `window` (None: full attention)."""
        return build_metadata(spans, self.block_size, window, self.device, self.config.dtype,
                              decode_kernel=self.decode_kernel,
                              prefill_kernel=self.prefill_kernel)

    def forward_last_logits(self, chunks: Sequence[tuple[Sequence[int], int, list[int]]]
                            ) -> torch.Tensor:
        """float32 logits [len(chunks), vocab] of each chunk's last token, for chunks
        (tokens, start, block table) computed into this runner's KV pool: the draft
        model's steps (model/draft.py), which have no SchedulerOutput of their own."""
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i][0]) != 1)
        ids: list[int] = []
        positions: list[int] = []
        spans = []
        last = [0] * len(chunks)
        for i in order:
            tokens, start, blocks = chunks[i]
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            spans.append((start, len(tokens), blocks))
            last[i] = len(ids) - 1
        meta = self._metadata(spans, self.config.sliding_window)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, pos, max(positions), self.kv_cache, meta)
        sel = hidden.index_select(0, torch.tensor(last, device=self.device))
        return self.model.logits(sel)

    @staticmethod
    def _row_ids(sampling: list[RequestState], drafts: dict[str, list[int]]) -> list:
        """The id of each logits row: the request's, and per verified draft position
        `verify_row_id` (what a grammar bitmask keys its rows by)."""
        if not drafts:
            return [st.req_id for st in sampling]
        ids: list = []
        for st in sampling:
            ids.append(st.req_id)
            for j in range(1, len(drafts.get(st.req_id, ())) + 1):
                ids.append(verify_row_id(st.req_id, j))
        return ids

    def compute_logits(self, output: SchedulerOutput) -> torch.Tensor:
        """float32 logits [N, vocab] of the sampling rows, in num_scheduled_tokens order (a
        request verifying k drafts has k + 1 rows); applies the step's data but samples
        nothing."""
        logits, _, _ = self._run(output)
        return logits

    def _run(self, output: SchedulerOutput
             ) -> tuple[torch.Tensor, list[RequestState], dict[str, list[int]]]:
        """The sampling rows' logits, their requests, and the drafts each verifies."""
        self.update_states(output)
        if self.draft is not None:
            self.draft.update(output)
        ops = output.kv_tiers
        bad: set[int] = set()
        if ops is not None:
            # Until the loads are done their blocks hold nothing: if this step fails before
            # then, the report names them all, so the cache forgets them.
            self._tier_report.invalid.update(b for _, b in ops.ram_loads)
            self.tier_store.save_and_read(ops)
        self.kv_cache.swap_out(output.blocks_to_swap_out)
        self.kv_cache.swap_in(output.blocks_to_swap_in)
        if ops is not None and ops.ram_loads:
            bad, ram_load = self.tier_store.load(ops)
            self._tier_report.loaded(ops, bad, ram_load)
        if not output.num_scheduled_tokens:
            return torch.empty(0, self.config.vocab_size), [], {}
        states = self.requests
        chunks: list[tuple[RequestState, int, int]] = []     # (state, start, num_tokens)
        starts = {d.req_id: d.num_computed_tokens for d in output.scheduled_new_reqs}
        for d in output.scheduled_cached_reqs:
            starts[d.req_id] = d.num_computed_tokens
        spec = output.scheduled_spec_decode_tokens
        drafts: dict[str, list[int]] = {}
        for rid, n in output.num_scheduled_tokens.items():
            st = states.get(rid)
            start = starts.get(rid)
            if st is None or start is None:
                raise ValueError(f"step {output.step}: request {rid!r} is scheduled but "
                                 "the runner has no data for it")
            d = spec.get(rid) if spec else None
            if d:
                if start != len(st.token_ids) - 1 or n != 1 + len(d):
                    raise ValueError(
                        f"request {rid!r} verifies {len(d)} drafts with {n} tokens from "
                        f"{start}; a verification starts at its last token "
                        f"({len(st.token_ids) - 1}) and has one token more than drafts")
                drafts[rid] = list(d)
            elif n < 1 or start < 0 or start + n > len(st.token_ids):
                raise ValueError(
                    f"chunk of request {rid!r} asks for tokens "
                    f"[{start}, {start + n}) of a {len(st.token_ids)}-token request")
            chunks.append((st, start, n))
        if self.draft is not None:
            asks = [(rid, states[rid].token_ids, starts[rid], len(d), states[rid].block_ids)
                    for rid, d in drafts.items() if d[0] == DRAFT_PLACEHOLDER]
            if asks:
                drafts.update(self.draft.propose(asks))
        recomputed: set[int] = set()
        if bad:
            chunks = self._recompute_bad_blocks(chunks, bad, recomputed)
        # Decodes and verifications (as decode rows) first: batched decode attention, and
        # the fused decode path for small steps; then prefill chunks. Stable within each.
        order = sorted(range(len(chunks)),
                       key=lambda i: chunks[i][2] != 1 and chunks[i][0].req_id not in drafts)
        ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}
        spans = []
        for i in order:
            st, start, n = chunks[i]
            d = drafts.get(st.req_id)
            if d is not None:
                ids.append(st.token_ids[start])
                ids.extend(d)
                positions.extend(range(start, start + n))
                spans.extend((start + j, 1, st.block_ids) for j in range(n))
                last_row[i] = len(ids) - 1
                continue
            ids.extend(st.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            last_row[i] = len(ids) - 1
            spans.append((start, n, st.block_ids))
        meta = self._metadata(spans, self.config.sliding_window)
        if self.window_blocks is not None:      # the sliding layers read their window pools
            wb = self.window_blocks
            window_spans = [(start, n, wb.table(chunks[i][0].req_id, start, n))
                            for i, (start, n, _) in zip(order, spans)]
            meta.variants[wb.window] = self._metadata(window_spans, wb.window)
            self._window_stats.update(wb.stats())
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, pos, max(positions), self.kv_cache, meta)
        self._tier_report.invalid.difference_update(recomputed)
        for i in order:                            # prompt_logprobs: the chunk's prompt rows
            st, start, n = chunks[i]
            if st.prompt_lps is not None:
                self._prompt_logprobs(st, start, n, hidden, last_row[i] - n + 1)
            if st.pool is not None:                # pooling: the chunk's rows to its pooler
                self._pool(st, start, n, hidden, last_row[i] - n + 1)
        sample_idx = [i for i, (st, start, n) in enumerate(chunks)
                      if start + n >= len(st.token_ids) and st.pool is None]
        if not sample_idx:
            return torch.empty(0, self.config.vocab_size), [], {}
        rows = []
        for i in sample_idx:
            st, _, n = chunks[i]
            if st.req_id in drafts:              # every verified position samples
                k = len(drafts[st.req_id]) + 1   # (n may be more: a recomputed block)
                rows.extend(range(last_row[i] - k + 1, last_row[i] + 1))
            else:
                rows.append(last_row[i])
        sel = hidden.index_select(0, torch.tensor(rows, device=self.device))
        return self.model.logits(sel), [chunks[i][0] for i in sample_idx], drafts

    def _recompute_bad_blocks(self, chunks: list[tuple[RequestState, int, int]],
                              bad: set[int], recomputed: set[int]
                              ) -> list[tuple[RequestState, int, int]]:
        """Start each chunk whose context holds a block a failed load left empty at that
        block, so this forward pass computes those tokens again (the chunk's end, and so
        what it samples, stays); `recomputed` gets the blocks it covers. Bad blocks no
        chunk covers stay in the report as invalid (their cache keys must go)."""
        bs = self.block_size
        out = []
        for st, start, n in chunks:
            first = next((i for i, b in enumerate(st.block_ids[:start // bs]) if b in bad),
                         None)
            if first is not None:
                recomputed.update(st.block_ids[first:start // bs])
                start, n = first * bs, n + start - first * bs
            out.append((st, start, n))
        return out

    def _pool(self, st: RequestState, start: int, n: int, hidden: torch.Tensor,
              first_row: int) -> None:
        """Feed a pooling request's chunk to the pooler; at its last token, its vector (the
        request then ends in the scheduler, which frees its blocks)."""
        pooler = self.pooler
        pooler.add(st.pool, hidden[first_row:first_row + n], start)
        if start + n >= len(st.token_ids):
            pp = st.pooling_params
            vec = pooler.finish(st.pool, pp.dimensions, pp.normalize)
            self._pooled[st.req_id] = PoolingOutput(vec.numpy(), len(st.token_ids))

    def _prompt_logprobs(self, st: RequestState, start: int, n: int, hidden: torch.Tensor,
                         first_row: int) -> None:
        """Append the entries of the chunk's rows that predict a prompt token (position p
        predicts token p + 1; run on every TP rank alike, as the LM head gathers)."""
        end = min(start + n, len(st.prompt_token_ids) - 1)
        if end <= start:
            return
        st.prompt_lps.extend(chunk_prompt_logprobs(
            self.model.logits, hidden[first_row:first_row + end - start],
            st.prompt_token_ids[start + 1:end + 1], st.sampling_params.prompt_logprobs))
