"""Paged attention with scores the fused kernels do not form: soft-capping, and sinks off
the native kernels.

Why a path of its own: Gemma 2 caps every attention score (`cap * tanh(s / cap)`), which does
not fit a fused softmax that never materialises the scores (SDPA, kernels/decode_attention.c,
prefill_attention.c). gpt-oss adds one learned "sink" logit per head to each softmax (a key
that takes probability mass and contributes no value): the native kernels fold it in
(attention_core.h), SDPA cannot, so gpt-oss steps that are not all on the native kernels
(CUDA, native kernels off) come here too. These layers compute the scores explicitly, in HF's
order: q.k * scale, the cap, the causal / sliding-window mask, the sink
column, softmax in float32, the sink dropped, times V. The K/V are read from the same paged
pools through the step's block tables (`AttentionMetadata.spans`), decodes batched (padded to
the longest context with a mask), each prefill chunk on its own. The index tensors a step
needs are built once per step and window and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from iterserve.model.attention import AttentionMetadata


@dataclass
class _StepIndex:
    num_decodes: int
    decode_slots: torch.Tensor | None        # [D, Lmax] (padded with slot 0, masked)
    decode_valid: torch.Tensor | None        # [D, Lmax] bool
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]]   # (row0, row1, slots, allowed)


def _index(meta: AttentionMetadata) -> _StepIndex:
    key = ("eager", meta.window)
    got = meta.variants.get(key)
    if got is not None:
        return got
    block_size, device = meta.build_args[0], meta.build_args[1]
    window = meta.window
    offsets = torch.arange(block_size)

    def slots_of(block_ids, total):
        blocks = torch.tensor(block_ids[:(total + block_size - 1) // block_size], dtype=torch.long)
        return (blocks[:, None] * block_size + offsets).flatten()[:total]

    seqs = meta.spans
    d = 0
    while d < len(seqs) and seqs[d][1] == 1:
        d += 1
    dec_slots = dec_valid = None
    if d:
        lens = torch.tensor([s + 1 for s, _, _ in seqs[:d]])
        lmax = int(lens.max())
        dec_slots = torch.zeros(d, lmax, dtype=torch.long)
        for i, (s, _, bt) in enumerate(seqs[:d]):
            dec_slots[i, :s + 1] = slots_of(bt, s + 1)
        k_pos = torch.arange(lmax)[None, :]
        dec_valid = k_pos < lens[:, None]
        if window is not None:
            dec_valid &= (lens[:, None] - 1 - k_pos) < window
        dec_slots, dec_valid = dec_slots.to(device), dec_valid.to(device)
    chunks = []
    row = d
    for s, n, bt in seqs[d:]:
        total = s + n
        q_pos = torch.arange(s, total)[:, None]
        k_pos = torch.arange(total)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= (q_pos - k_pos) < window
        chunks.append((row, row + n, slots_of(bt, total).to(device), allowed.to(device)))
        row += n
    got = meta.variants[key] = _StepIndex(d, dec_slots, dec_valid, chunks)
    return got


def _softmax_out(scores: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor,
                 softcap: float | None, sinks: torch.Tensor | None, eq: str) -> torch.Tensor:
    """scores (already scaled, the key axis last); allowed broadcastable to them; v as `eq`
    needs; sinks broadcastable to scores without their key axis, or None."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1]).unsqueeze(-1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores.float(), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores.float(), dim=-1)
    return torch.einsum(eq, probs.to(v.dtype), v)


def eager_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_slots: torch.Tensor, v_slots: torch.Tensor, meta: AttentionMetadata,
                          scale: float, softcap: float | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, d], k/v [T, KV, d] of the step's new tokens -> attention output [T, H, d]
    (the new K/V are written to the pools first, as `attention.paged_attention` does)."""
    T, kvh, d = k.shape
    H = q.shape[1]
    g = H // kvh
    k_slots.index_copy_(0, meta.slot_mapping, k.reshape(T, kvh * d).to(k_slots.dtype))
    v_slots.index_copy_(0, meta.slot_mapping, v.reshape(T, kvh * d).to(v_slots.dtype))
    idx = _index(meta)
    sk = None if sinks is None else sinks.view(kvh, g)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    D = idx.num_decodes
    if D:
        L = idx.decode_slots.shape[1]
        kc = k_slots.index_select(0, idx.decode_slots.flatten()).to(q.dtype).view(D, L, kvh, d)
        vc = v_slots.index_select(0, idx.decode_slots.flatten()).to(q.dtype).view(D, L, kvh, d)
        qd = q[:D].view(D, kvh, g, d)
        scores = torch.einsum("bkgh,blkh->bkgl", qd, kc) * scale
        o = _softmax_out(scores, idx.decode_valid[:, None, None, :], vc, softcap,
                         None if sk is None else sk[None], "bkgl,blkh->bkgh")
        out[:D] = o.reshape(D, H, d)
    for r0, r1, slots, allowed in idx.chunks:
        n, L = r1 - r0, slots.shape[0]
        kc = k_slots.index_select(0, slots).to(q.dtype).view(L, kvh, d)
        vc = v_slots.index_select(0, slots).to(q.dtype).view(L, kvh, d)
        qc = q[r0:r1].view(n, kvh, g, d)
        scores = torch.einsum("ckgh,lkh->kgcl", qc, kc) * scale
        o = _softmax_out(scores, allowed, vc, softcap, None if sk is None else sk[:, :, None],
                         "kgcl,lkh->ckgh")
        out[r0:r1] = o.reshape(n, H, d)
    return out
