"""Attention over the paged KV cache for one flattened step (decodes + prefill chunks).

The runner orders a step's tokens as [all decodes (1 token each), then each prefill chunk],
so the decode rows are one contiguous block. Per step (not per layer) it builds an
AttentionMetadata: the slot each new token's K/V goes to, and the slots to gather each
sequence's context from. Then in every layer:

- decodes: on CPU float32, the native kernel (kernels/decode_attention.c) reads each
  sequence's K/V straight from the pool through its block table, once, unpadded. Otherwise
  one batched SDPA: context slots are gathered and padded to the longest context with a key
  mask; grouped-query heads stay grouped (SDPA enable_gqa) - expanding K/V per query head
  was measured 4-20x slower from batch 32 up.
- prefill chunks: with the native kernels (CPU float32, float32/f16/bf16 pools) all chunks
  of the step go to one call of kernels/prefill_attention.c, which reads each chunk's context straight from the pools
  through its block table (flash-style online softmax, causal within the chunk, GQA grouped,
  sliding windows). A 128-token chunk at context 1500 was ~11x its cost at context 0 on the
  torch path below (index_select of the whole context, then SDPA with an explicit
  [chunk, context] mask); benchmarks/bench_attention.py measures both. Otherwise (and with
  PREFILL_NATIVE off): one SDPA per chunk over [its cached prefix + the chunk] with a causal
  mask offset by the prefix length (measured faster than a block-diagonal mask over all
  chunks).

Batch invariance: the two native kernels share one order of operations
(kernels/attention_core.h), so a query's output is bitwise the same whether it is a decode
row or in a prefill chunk of any size, after any cached prefix, beside any other sequences.
bf16 pools have no native decode kernel: there every sequence, decodes included, goes to the
prefill kernel as a chunk (a decode is a one-token chunk; the same arithmetic). The torch
paths (no native kernels, CUDA, ITERSERVE_PREFILL_ATTENTION=0) give no such guarantee: SDPA's
blocking follows the padded shapes of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from iterserve import envs
from iterserve.model import kernels

# Prefill chunks through kernels/prefill_attention.c wherever the decodes use the native
# kernel. ITERSERVE_PREFILL_ATTENTION=0 (or setting this False) keeps the torch path for A/B.
PREFILL_NATIVE = envs.ITERSERVE_PREFILL_ATTENTION


@dataclass(slots=True)
class PrefillSeq:
    q_start: int                    # first row of this chunk in the flattened batch
    q_end: int
    context_slots: torch.Tensor     # [L] slots of positions 0..start+num_tokens-1
    mask: torch.Tensor | None       # [C, L] additive (0 / -inf); None = plain causal (C == L)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor                   # [T] where each new token's K/V is written
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None     # [D * Lmax] context slots, row-major
    decode_len: int = 0                          # Lmax
    decode_mask: torch.Tensor | None = None      # [D, 1, 1, Lmax] additive, None if no padding
    decode_kernel: object = None                 # native decode attention (then the two below)
    decode_tables: torch.Tensor | None = None    # [D, max blocks] int32 block tables
    decode_lens: torch.Tensor | None = None      # [D] int32 context lengths (new token included)
    sliding_window: int = 0                      # 0 = none
    block_size: int = 0
    prefills: list[PrefillSeq] = field(default_factory=list)    # chunks on the torch path
    # chunks on the native prefill kernel (then all of the step's chunks): tables, starts and
    # lengths checked once here, run per layer
    prefill_chunks: kernels.PrefillChunks | None = None
    # What the step was built from, so a layer with another sliding window (Gemma's sliding
    # and global layers in one model) gets its own metadata once per step (`for_window`).
    spans: list = field(default_factory=list)
    window: int | None = None
    build_args: tuple = ()
    variants: dict = field(default_factory=dict)


def _additive(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Bool "may attend" -> 0 / -inf in the model dtype. Made once per step: SDPA would
    otherwise convert a bool mask in every layer (measured: 2 `where` calls per layer)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf")).to(device)


def build_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int,
                   sliding_window: int | None, device: torch.device,
                   dtype: torch.dtype = torch.float32, decode_kernel=None,
                   prefill_kernel: bool = False) -> AttentionMetadata:
    """seqs: (start, num_tokens, block_ids) in flattened order, decodes (num_tokens == 1) first.

    With `decode_kernel` (kernels.decode_attention(), CPU float32 only) the decodes get block
    tables and lengths for it instead of gather slots and a padding mask, and (PREFILL_NATIVE)
    the prefill chunks block tables (kernels.PrefillChunks) instead of context slots
    and masks. `prefill_kernel` without a decode kernel (bf16 pools) sends every sequence,
    decodes included, to the prefill kernel (PREFILL_NATIVE)."""
    for start, n, block_ids in seqs:
        if len(block_ids) * block_size < start + n:
            raise ValueError(f"block table of {len(block_ids)} blocks cannot hold {start + n} "
                             f"tokens (block_size {block_size})")
    native_chunks = PREFILL_NATIVE and (decode_kernel is not None or prefill_kernel)
    num_decodes = 0
    if decode_kernel is not None or not native_chunks:
        while num_decodes < len(seqs) and seqs[num_decodes][1] == 1:
            num_decodes += 1
    offsets = torch.arange(block_size)
    new_slots: list[torch.Tensor] = []
    meta = AttentionMetadata(slot_mapping=torch.empty(0))

    if num_decodes:
        # All decode contexts in one [D, Lmax] slot table, built with a few batched ops.
        lens = [start + 1 for start, _, _ in seqs[:num_decodes]]
        lmax = max(lens)
        nb = (lmax + block_size - 1) // block_size
        table = torch.tensor([bt[:nb] + [0] * (nb - len(bt[:nb])) for _, _, bt in seqs[:num_decodes]],
                             dtype=torch.long)
        slots = (table[:, :, None] * block_size + offsets).view(num_decodes, nb * block_size)[:, :lmax]
        lens_t = torch.tensor(lens)
        new_slots.append(slots[torch.arange(num_decodes), lens_t - 1])
        meta.num_decodes, meta.decode_len = num_decodes, lmax
        if decode_kernel is not None:
            meta.decode_kernel = decode_kernel
            meta.decode_tables = table.to(torch.int32)
            meta.decode_lens = lens_t.to(torch.int32)
            meta.sliding_window = sliding_window or 0
            meta.block_size = block_size
        else:
            meta.decode_slots = slots.reshape(-1).to(device)
            k_pos = torch.arange(lmax)[None, :]
            valid = k_pos < lens_t[:, None]          # padded positions of shorter contexts
            if sliding_window is not None:
                valid &= (lens_t[:, None] - 1 - k_pos) < sliding_window
            if not bool(valid.all()):
                meta.decode_mask = _additive(valid[:, None, None, :], dtype, device)

    row = num_decodes
    prefill_seqs = seqs[num_decodes:]
    if native_chunks and prefill_seqs:
        # The new tokens' slots straight from the tables; no context slots, no masks.
        nbs = [(start + n + block_size - 1) // block_size for start, n, _ in prefill_seqs]
        mb = max(nbs)
        rows, q_starts = [], []
        for (start, n, block_ids), nb in zip(prefill_seqs, nbs):
            rows.append(block_ids[:nb] + [0] * (mb - nb))
            q_starts.append(row)
            pos = torch.arange(start, start + n)
            new_slots.append(torch.tensor(block_ids[:nb], dtype=torch.long)[pos // block_size]
                             * block_size + pos % block_size)
            row += n
        i32 = dict(dtype=torch.int32)
        meta.prefill_chunks = kernels.PrefillChunks(
            torch.tensor(q_starts, **i32), torch.tensor([s for s, _, _ in prefill_seqs], **i32),
            torch.tensor([n for _, n, _ in prefill_seqs], **i32), torch.tensor(rows, **i32),
            sliding_window or 0, block_size)
        meta.sliding_window = sliding_window or 0
        meta.block_size = block_size
        prefill_seqs = []
    for start, n, block_ids in prefill_seqs:
        total = start + n
        blocks = torch.tensor(block_ids[:(total + block_size - 1) // block_size], dtype=torch.long)
        ctx = (blocks[:, None] * block_size + offsets).flatten()[:total]
        new_slots.append(ctx[start:])
        mask = None
        if start > 0 or (sliding_window is not None and total > sliding_window):
            q_pos = torch.arange(start, total)[:, None]
            k_pos = torch.arange(total)[None, :]
            allowed = k_pos <= q_pos
            if sliding_window is not None:
                allowed &= (q_pos - k_pos) < sliding_window
            mask = _additive(allowed, dtype, device)
        meta.prefills.append(PrefillSeq(row, row + n, ctx.to(device), mask))
        row += n
    meta.slot_mapping = torch.cat(new_slots).to(device)
    meta.spans, meta.window = seqs, sliding_window
    meta.build_args = (block_size, device, dtype, decode_kernel)
    return meta


def for_window(meta: AttentionMetadata, window: int | None) -> AttentionMetadata:
    """The step's metadata for layers attending within `window` (None: the whole context):
    `meta` itself when it was built for that window, else built once per step and kept."""
    if window == meta.window:
        return meta
    if not meta.build_args:
        raise ValueError(f"metadata for window {meta.window} was not made by build_metadata; "
                         f"it cannot be rebuilt for window {window}")
    got = meta.variants.get(window)
    if got is None:
        block_size, device, dtype, decode_kernel = meta.build_args
        got = meta.variants[window] = build_metadata(meta.spans, block_size, window, device,
                                                     dtype, decode_kernel=decode_kernel)
    return got


def native_step(meta: AttentionMetadata) -> bool:
    """Whether every row of the step runs on the native kernels (decodes on the decode kernel,
    chunks on the prefill kernel): what attention sinks need, the torch path having none."""
    return (meta.num_decodes == 0 or meta.decode_kernel is not None) and not meta.prefills


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_slots: torch.Tensor, v_slots: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, d], k/v [T, kv, d] of the new tokens -> attention output [T, H, d].

    Writes the new K/V into the pools (2-D slot views) first, so every sequence reads its
    context (cached prefix + this step's tokens) from one place. `sinks` (float32 [H],
    gpt-oss) only where `native_step(meta)`: the kernels fold them into each row's softmax.
    """
    if sinks is not None and not native_step(meta):
        raise ValueError("attention sinks need the native kernels for every row of the step")
    T, kvh, d = k.shape
    # The pools may be narrower than the activations (--kv-cache-dtype float16/bfloat16):
    # K/V are rounded when written and widened back to q's dtype when read.
    k_slots.index_copy_(0, meta.slot_mapping, k.reshape(T, kvh * d).to(k_slots.dtype))
    v_slots.index_copy_(0, meta.slot_mapping, v.reshape(T, kvh * d).to(v_slots.dtype))
    D = meta.num_decodes
    if D == T:                                  # decode-only step: nothing to assemble
        return _decode_attention(q, k_slots, v_slots, meta, scale, kvh, d, sinks)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if D:
        out[:D] = _decode_attention(q[:D], k_slots, v_slots, meta, scale, kvh, d, sinks)
    if meta.prefill_chunks is not None:
        meta.prefill_chunks.run(q.contiguous(), k_slots, v_slots, scale, out, sinks=sinks)
    for p in meta.prefills:
        L = p.context_slots.shape[0]
        kc = k_slots.index_select(0, p.context_slots).to(q.dtype).view(L, kvh, d) \
            .transpose(0, 1).unsqueeze(0)
        vc = v_slots.index_select(0, p.context_slots).to(q.dtype).view(L, kvh, d) \
            .transpose(0, 1).unsqueeze(0)
        qp = q[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)     # [1, H, C, d]
        o = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=p.mask,
                                           is_causal=p.mask is None, scale=scale, enable_gqa=True)
        out[p.q_start:p.q_end] = o.squeeze(0).transpose(0, 1)
    return out


def _decode_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                      meta: AttentionMetadata, scale: float, kvh: int, d: int,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its context; q [D, H, d] -> [D, H, d]."""
    D, L = q.shape[0], meta.decode_len
    if meta.decode_kernel is not None:
        q = q.contiguous()
        return kernels.decode_attention(q, k_slots, v_slots, meta.decode_tables, meta.decode_lens,
                                        meta.sliding_window, meta.block_size, scale,
                                        torch.empty_like(q), sinks)
    kc = k_slots.index_select(0, meta.decode_slots).to(q.dtype).view(D, L, kvh, d).transpose(1, 2)
    vc = v_slots.index_select(0, meta.decode_slots).to(q.dtype).view(D, L, kvh, d).transpose(1, 2)
    return F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=meta.decode_mask,
                                          scale=scale, enable_gqa=True).squeeze(2)
