"""MXFP4 (OCP microscaling FP4): gpt-oss's expert weights, in GGML's block layout.

A GGML MXFP4 block is 17 bytes for 32 weights: one E8M0 scale byte (a power of two), then 16
bytes of 4-bit E2M1 codes, the low nibble of byte j weight j and the high nibble weight
j + 16 (the Q4_0 order). A weight is `kvalues[code] * 2^(e - 128)` with the values doubled
(0, 1, 2, 3, 4, 6, 8, 12 and their negatives) and the scale halved, exactly as gguf-py's
reference dequantiser computes it (`gguf.quants.MXFP4`), so results are bit-identical to it.

gpt-oss's HF checkpoint stores the same codes and scales in two tensors (`*_blocks` [.., 16]
with the low nibble weight 2j and the high nibble 2j + 1, and `*_scales`); `from_hf_blocks`
reorders the nibbles into GGML blocks (what llama.cpp's converter does), one expert at a time.

This is the torch path, for a build without the native kernels: kernels/dequant.c decodes
the same blocks bit for bit (`dec_mxfp4`), which gives MXFP4 the generic decode GEMM, the
panel GEMM and the native dequant behind dispatch.c's table like the other block types.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

MXFP4 = int(GGMLQuantizationType.MXFP4)
BLOCK, BLOCK_BYTES = 32, 17
_KVALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                        dtype=torch.float32)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) as float32 for E8M0 bytes (ggml_e8m0_to_fp32_half), denormals included."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dequant(w: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP4 rows (uint8 [n, k / 32 * 17]) -> float32 [n, k]."""
    n = w.shape[0]
    if k % BLOCK or w.shape[-1] != k // BLOCK * BLOCK_BYTES:
        raise ValueError(f"MXFP4 rows of {w.shape[-1]} bytes do not hold {k} weights")
    b = w.reshape(n, k // BLOCK, BLOCK_BYTES)
    d = e8m0_half(b[..., 0])
    qs = b[..., 1:].to(torch.int64)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)            # weights j and j + 16
    vals = _KVALUES[codes] * d[..., None]
    vals = vals.view(n, k)
    if out is None:
        return vals
    out.copy_(vals)
    return out


def from_hf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF's `*_blocks` bytes (uint8, [rows * k/32 * 16]) and `*_scales` (uint8, [rows *
    k/32]) of one expert -> GGML MXFP4 blocks uint8 [rows * k/32, 17] (a new tensor)."""
    nb = scales.numel()
    if blocks.numel() != nb * 16:
        raise ValueError(f"MXFP4 blocks ({blocks.numel()} bytes) and scales ({nb}) disagree")
    q = blocks.reshape(nb, 16)
    el = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(nb, 32)   # HF: weight 2j, 2j + 1
    packed = el[:, :16] | (el[:, 16:] << 4)                          # GGML: weight j, j + 16
    return torch.cat([scales.reshape(nb, 1), packed], dim=1).contiguous()
