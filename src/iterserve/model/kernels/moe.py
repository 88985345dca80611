"""The binding of moe.c: a Mixture-of-Experts block (router, routing, experts) in one call.

`MoeBlock` builds the C descriptor (iterserve.h's iterserve_moe) once per layer from the
experts' encoded segments, checks every shape, and runs small steps (`forward`); the fused
decode step (decode_layers.c) points at the same descriptor. `route` is moe.c's routing on
its own, for the row counts that run the experts through the prefill GEMMs, so a token is
routed the same way whatever its step holds.
"""

from __future__ import annotations

import ctypes

import torch

from iterserve.model.kernels._abi import Linear, Moe
from iterserve.model.kernels.build import _lib, available, supports_qgemm
from iterserve.model.kernels.ops import _f32, _rc, _threads, linear_struct


def route(logits: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits float32 [T, E]:
    the k largest softmax probabilities (ties to the lower id), renormalised when norm_topk."""
    _f32(logits, "logits", 2)
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k {top_k} of {E} experts")
    w = torch.empty(T, top_k, dtype=torch.float32)
    ids = torch.empty(T, top_k, dtype=torch.int64)
    if T:
        _lib().iterserve_moe_route(logits.data_ptr(), T, E, top_k, int(norm_topk),
                                   w.data_ptr(), ids.data_ptr())
    return w, ids


class MoeBlock:
    """One MoE layer for moe.c: `router` and each expert's `gate_up` (gate rows then up rows)
    and `down` as lists of `(ggml_type, w)` row segments of GGUF blocks."""

    def __init__(self, router, gate_up: list, down: list, hidden: int, inter: int,
                 top_k: int, norm_topk: bool) -> None:
        E = len(gate_up)
        if E < 1 or len(down) != E or not 1 <= top_k <= E:
            raise ValueError(f"{E} gate/up and {len(down)} down experts, top {top_k}")
        self.hidden, self.inter, self.num_experts, self.top_k = hidden, inter, E, top_k
        self._keep: list[torch.Tensor] = []
        self._gate_up = (Linear * E)()
        self._down = (Linear * E)()
        self._moe = Moe(num_experts=E, top_k=top_k, inter=inter, norm_topk=int(norm_topk))
        linear_struct(self._moe.router, router, E, hidden, "router", self._keep)
        for e in range(E):
            linear_struct(self._gate_up[e], gate_up[e], 2 * inter, hidden,
                          f"expert {e} gate_up", self._keep)
            linear_struct(self._down[e], down[e], hidden, inter, f"expert {e} down", self._keep)
        self._moe.gate_up = ctypes.addressof(self._gate_up)
        self._moe.down = ctypes.addressof(self._down)
        self._fn = _lib().iterserve_moe_forward

    @staticmethod
    def supported(router, gate_up: list, down: list) -> bool:
        """Whether the library is available and every segment type has a qgemm."""
        return available() and all(supports_qgemm(t) for segs in (router, *gate_up, *down)
                                   for t, _ in segs)

    @property
    def address(self) -> int:
        """The iterserve_moe descriptor's address (valid while this object lives)."""
        return ctypes.addressof(self._moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output float32 [T, hidden] for x float32 contiguous [T, hidden]."""
        _f32(x, "x", 2)
        if x.shape[1] != self.hidden:
            raise ValueError(f"x has {x.shape[1]} columns, the experts take {self.hidden}")
        out = torch.empty(x.shape[0], self.hidden, dtype=torch.float32)
        if x.shape[0]:
            _rc(self._fn(self.address, x.data_ptr(), x.shape[0], self.hidden, out.data_ptr(),
                         _threads()))
        return out
