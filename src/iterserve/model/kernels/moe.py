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


ROUTINGS = {"softmax_topk": 0, "topk_softmax": 1}     # iterserve.h ITERSERVE_ROUTE_*
ACTS = {"silu": 0, "swiglu_oai": 1}                   # iterserve.h ITERSERVE_MOE_*


def route(logits: torch.Tensor, top_k: int, norm_topk: bool, routing: str = "softmax_topk"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits float32 [T, E]:
    the k largest softmax probabilities (ties to the lower id), renormalised when norm_topk
    ("softmax_topk"), or a softmax over the k largest logits ("topk_softmax", gpt-oss)."""
    _f32(logits, "logits", 2)
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k {top_k} of {E} experts")
    w = torch.empty(T, top_k, dtype=torch.float32)
    ids = torch.empty(T, top_k, dtype=torch.int64)
    if T:
        _lib().iterserve_moe_route(logits.data_ptr(), T, E, top_k, int(norm_topk),
                                   ROUTINGS[routing], w.data_ptr(), ids.data_ptr())
    return w, ids


class MoeBlock:
    """One MoE layer for moe.c: `router` and each expert's `gate_up` (gate rows then up rows,
    or alternating when `interleaved`) and `down` as lists of `(ggml_type, w)` row segments of
    GGUF blocks; `routing` and `act` name iterserve.h's ITERSERVE_ROUTE_* / ITERSERVE_MOE_*
    (moe.py's names); the biases float32 tensors (the router's [E], each expert's [2 inter]
    and [hidden]) or None."""

    def __init__(self, router, gate_up: list, down: list, hidden: int, inter: int,
                 top_k: int, norm_topk: bool, routing: str = "softmax_topk", act: str = "silu",
                 interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0,
                 router_bias: torch.Tensor | None = None, gate_up_bias: list | None = None,
                 down_bias: list | None = None) -> None:
        E = len(gate_up)
        if E < 1 or len(down) != E or not 1 <= top_k <= E:
            raise ValueError(f"{E} gate/up and {len(down)} down experts, top {top_k}")
        self.hidden, self.inter, self.num_experts, self.top_k = hidden, inter, E, top_k
        self._keep: list = []          # what the descriptor points into
        self._gate_up = (Linear * E)()
        self._down = (Linear * E)()
        self._moe = Moe(num_experts=E, top_k=top_k, inter=inter, norm_topk=int(norm_topk),
                        routing=ROUTINGS[routing], act=ACTS[act], interleaved=int(interleaved),
                        alpha=alpha, limit=limit)
        linear_struct(self._moe.router, router, E, hidden, "router", self._keep)
        for e in range(E):
            linear_struct(self._gate_up[e], gate_up[e], 2 * inter, hidden,
                          f"expert {e} gate_up", self._keep)
            linear_struct(self._down[e], down[e], hidden, inter, f"expert {e} down", self._keep)
        self._moe.gate_up = ctypes.addressof(self._gate_up)
        self._moe.down = ctypes.addressof(self._down)
        self._moe.router_bias = self._bias(router_bias, E, "router")
        for field, biases, n in (("gate_up_bias", gate_up_bias, 2 * inter),
                                 ("down_bias", down_bias, hidden)):
            if biases is not None:
                if len(biases) != E:
                    raise ValueError(f"{len(biases)} {field}es for {E} experts")
                ptrs = (ctypes.c_void_p * E)(*(self._bias(b, n, f"expert {e} {field}")
                                               for e, b in enumerate(biases)))
                self._keep.append(ptrs)
                setattr(self._moe, field, ctypes.addressof(ptrs))
        self._fn = _lib().iterserve_moe_forward

    def _bias(self, b: torch.Tensor | None, n: int, name: str) -> int | None:
        """A bias's address (kept alive with the block), after checking it; None for none."""
        if b is None:
            return None
        b = b.detach()
        _f32(b, name, 1)
        if b.shape[0] != n:
            raise ValueError(f"{name} has {b.shape[0]} values, the block needs {n}")
        self._keep.append(b)
        return b.data_ptr()

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
