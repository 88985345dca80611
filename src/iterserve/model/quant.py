"""GGUF block-quantised weights kept as blocks, for the native decode GEMM.

A GGUF Q4_0/Q4_1/Q8_0 tensor stores each row as blocks of 32 weights sharing a float16 scale
d (and, for Q4_1, a float16 min m): w = d*q + m. The loader dequantises every tensor to
float32 for the model's reference path, and also keeps these three kinds as a
`BlockQuantWeight`. `layers.Linear` then runs small-row GEMMs (decode steps) through
`kernels/qgemm.c`, which reads ~0.6 byte per Q4 weight instead of 4: decode is bound by
streaming weights, so this is the difference between 538 MB and 96 MB per step on the
default model. The kernel dequantises exactly as gguf-py does, so results equal a float32
GEMM over the same dequantised weights up to summation order.

Storage: `qs` uint8 [N, K/32 * bytes] in GGUF's in-block order, `d` and `m` float32 [N, K/32]
(the float16 values widened once at load, so the kernel needs no F16C conversion per block).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
# kind -> (kernel id, bytes of quants per block, has a min)
KINDS = {"Q4_0": (0, 16, False), "Q4_1": (1, 16, True), "Q8_0": (2, 32, False)}
# GGUF block layout: header (d, optional m as float16) then the quants.
_HEADER = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}


@dataclass
class BlockQuantWeight:
    kind: str
    qs: torch.Tensor             # uint8 [N, K/32 * quant bytes per block]
    d: torch.Tensor              # float32 [N, K/32]
    m: torch.Tensor | None       # float32 [N, K/32] for Q4_1, else None

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    @classmethod
    def from_gguf(cls, kind: str, raw: np.ndarray, shape: tuple[int, int]) -> "BlockQuantWeight":
        """From a GGUF tensor's raw bytes (`GGUFReader` tensor.data) and its [N, K] shape."""
        if kind not in KINDS:
            raise ValueError(f"{kind} is not a block kind the native kernel reads ({sorted(KINDS)})")
        n, k = shape
        if k % BLOCK:
            raise ValueError(f"row length {k} is not a multiple of {BLOCK}")
        nb, header, qbytes = k // BLOCK, _HEADER[kind], KINDS[kind][1]
        blocks = np.asarray(raw, dtype=np.uint8).reshape(n, nb, header + qbytes)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) \
            if kind == "Q4_1" else None
        qs = np.ascontiguousarray(blocks[..., header:]).reshape(n, nb * qbytes)
        return cls(kind, torch.from_numpy(qs), torch.from_numpy(np.ascontiguousarray(d)),
                   None if m is None else torch.from_numpy(np.ascontiguousarray(m)))

    def rows(self, index: torch.Tensor | np.ndarray) -> "BlockQuantWeight":
        """The same weight with its output rows reordered (llama's Q/K un-permutation)."""
        idx = torch.as_tensor(np.asarray(index), dtype=torch.long)
        return BlockQuantWeight(self.kind, self.qs[idx].contiguous(), self.d[idx].contiguous(),
                                None if self.m is None else self.m[idx].contiguous())

    @staticmethod
    def cat(parts: list["BlockQuantWeight"]) -> "BlockQuantWeight | None":
        """Row-wise concatenation (fused q/k/v, gate/up); None unless all share kind and K."""
        if not parts or any(p is None for p in parts) \
                or len({(p.kind, p.shape[1]) for p in parts}) != 1:
            return None
        if len(parts) == 1:
            return parts[0]
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return BlockQuantWeight(parts[0].kind, torch.cat([p.qs for p in parts]),
                                torch.cat([p.d for p in parts]), m)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], computed as gguf-py does (the reference the kernel must match)."""
        n, k = self.shape
        nb = k // BLOCK
        if self.kind == "Q8_0":
            q = self.qs.view(torch.int8).view(n, nb, BLOCK).float()
            return (q * self.d[..., None]).view(n, k)
        raw = self.qs.view(n, nb, BLOCK // 2)
        q = torch.cat([raw & 0x0F, raw >> 4], dim=-1).float()
        if self.kind == "Q4_0":
            return (self.d[..., None] * (q - 8)).view(n, k)
        return (self.d[..., None] * q + self.m[..., None]).view(n, k)

    def matmul(self, x: torch.Tensor, fn, threads: int) -> torch.Tensor:
        """x [M, K] float32 -> x @ W^T [M, N] through the native kernel `fn`."""
        x = x.contiguous()
        n, k = self.shape
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        fn(KINDS[self.kind][0], x.data_ptr(), x.shape[0], k, self.qs.data_ptr(),
           self.d.data_ptr(), 0 if self.m is None else self.m.data_ptr(), y.data_ptr(), n,
           threads)
        return y
