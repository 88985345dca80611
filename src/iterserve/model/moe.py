"""Mixture-of-Experts layers: a router picks k experts per token; each is a gated MLP.

Why this shape: a token reads only its experts' weights, so a decode step costs the bytes of
the active parameters (Qwen3-30B-A3B: ~3B of 30B). The forward pass groups the step's
(token, expert) pairs by expert and runs each active expert once over all of its tokens:
one GEMM per active expert and projection (a decode of one token: its k experts; a prefill
chunk: every expert some token chose, each over its tokens), through `layers.Linear`, so
every expert runs on the same kernels as a dense layer (native decode GEMM, prefill GEMM or
the reference tiles) and stays in its file's encoding: a view of the mapped file, never a
copy (`loader.Placement.matrix(..., copy=False)`), counted once by the memory plan.

Routing follows each model's own normalisation:
- "softmax_topk" (Qwen3-MoE, Mixtral): softmax over all experts' logits in float32, the top
  k, renormalised to sum 1 when `norm_topk_prob` (Mixtral always);
- "topk_softmax" (gpt-oss): the top k logits (the router has a bias), softmax over those k.
Expert activations: "silu" (SwiGLU, gate and up halves) or "swiglu_oai" (gpt-oss: gate
clamped above at `limit`, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1));
gpt-oss's HF checkpoint interleaves gate and up rows (`interleaved`), its GGUF does not.
The outputs are weighted and summed per token in ascending expert order, as HF does.

On the CPU with the native kernels (`SparseMoE.use_native`), every MoE layer here
(Qwen3-MoE, Mixtral, gpt-oss with its biases, routing and activation, either gate/up
layout) routes through moe.c at every row count, and a step of at most QUANT_MAX_ROWS rows
(decode) runs the whole block in one native call (`kernels.MoeBlock`), the call the fused
decode step makes too: the same order of arithmetic as the loop below, without its
per-expert Python; the loop's experts take moe.c's activation kernels (elementwise.c).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model.config import ModelConfig
from iterserve.model.layers import QUANT_MAX_ROWS, Linear


class Expert(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.inter = c.moe_intermediate_size
        self.gate_up_proj = Linear(c.hidden_size, 2 * self.inter, bias=c.expert_bias)
        self.down_proj = Linear(self.inter, c.hidden_size, bias=c.expert_bias)
        self.act = c.expert_act
        self.alpha, self.limit = c.swiglu_alpha, c.swiglu_limit
        self.interleaved = False       # gate/up rows alternate (gpt-oss's HF layout)

    _native = None   # kernels.silu_mul, set by the model's use_native_ops
    _native_oai = None   # kernels.swiglu_oai (moe.c's activation), set with _native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if self.act == "swiglu_oai" and self._native_oai is not None \
                and gu.dtype == torch.float32 and gu.is_contiguous() and gu.device.type == "cpu":
            act = self._native_oai(gu, torch.empty(gu.shape[0], self.inter), self.interleaved,
                                   self.alpha, self.limit)
            return self.down_proj(act)
        if self.interleaved:
            gate, up = gu[:, 0::2], gu[:, 1::2]
        elif self.act == "silu" and self._native is not None and gu.dtype == torch.float32 \
                and gu.is_contiguous() and gu.device.type == "cpu":
            return self.down_proj(self._native(gu, torch.empty(gu.shape[0], self.inter)))
        else:
            gate, up = gu[:, :self.inter], gu[:, self.inter:]
        if self.act == "silu":
            return self.down_proj(F.silu(gate) * up)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


def _segments(lin: Linear) -> list | None:
    """A Linear's weight as row segments for the native block: its encoded ones on the native
    GEMM, or a dense float32 weight as one F32 segment over the same memory (a GGUF router is
    F32, which the loader keeps dense); None otherwise."""
    if lin.encoded is not None:
        return list(lin.encoded.segments) if lin.compute_path() == "native" else None
    w = lin.weight
    if w is None or w.dtype != torch.float32 or w.device.type != "cpu" \
            or not w.is_contiguous() or lin.in_features % 32:
        return None
    return [(0, w.detach().view(torch.uint8))]                   # ggml type 0: F32


class SparseMoE(nn.Module):
    """The MoE block in place of a dense MLP: `router` (a Linear over hidden -> experts) and
    `experts` (one `Expert` each)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = c.num_experts, c.num_experts_per_tok
        self.routing, self.norm_topk_prob = c.router, c.norm_topk_prob
        self.hidden = c.hidden_size
        self.router = Linear(c.hidden_size, c.num_experts, bias=c.router_bias)
        self.experts = nn.ModuleList(Expert(c) for _ in range(c.num_experts))
        self.native_ok = c.native_moe

    _route = None      # kernels.moe_route, set by use_native
    _block = None      # kernels.MoeBlock for small steps, set by use_native

    def use_native(self, on: bool = True) -> bool:
        """Route through moe.c (`kernels.moe_route`, every row count) and run steps of at most
        QUANT_MAX_ROWS rows as one `kernels.MoeBlock` call, or neither; returns whether the
        block is in use. The block needs a layer moe.c knows (`ModelConfig.native_moe`), every
        expert on the native GEMM (use_quant), the router there too or dense float32, and
        float32 biases; the routing needs only the first."""
        from iterserve.model import kernels
        self._route = self._block = None
        if not on or not self.native_ok or not kernels.available():
            return False
        self._route = kernels.moe_route
        experts = [m for e in self.experts for m in (e.gate_up_proj, e.down_proj)]
        router = _segments(self.router)
        if router is None or any(m.compute_path() != "native" for m in experts):
            return False
        gate_up = [list(e.gate_up_proj.encoded.segments) for e in self.experts]
        down = [list(e.down_proj.encoded.segments) for e in self.experts]
        if not kernels.MoeBlock.supported(router, gate_up, down):
            return False
        biases = [self.router.bias] + [m.bias for m in experts]
        if any(b is not None and (b.dtype != torch.float32 or b.device.type != "cpu")
               for b in biases):
            return False
        e0 = self.experts[0]
        has_bias = e0.gate_up_proj.bias is not None
        self._block = kernels.MoeBlock(
            router, gate_up, down, self.hidden, e0.inter, self.top_k, self.norm_topk_prob,
            routing=self.routing, act=e0.act, interleaved=e0.interleaved, alpha=e0.alpha,
            limit=e0.limit, router_bias=self.router.bias,
            gate_up_bias=[e.gate_up_proj.bias for e in self.experts] if has_bias else None,
            down_bias=[e.down_proj.bias for e in self.experts] if has_bias else None)
        return True

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E]."""
        logits = logits.float()
        if self._route is not None and logits.device.type == "cpu":
            return self._route(logits.contiguous(), self.top_k, self.norm_topk_prob,
                               self.routing)
        if self.routing == "topk_softmax":
            top, idx = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), idx
        probs = torch.softmax(logits, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        if self._block is not None and T <= QUANT_MAX_ROWS and x.dtype == torch.float32 \
                and x.device.type == "cpu":
            return self._block.forward(x.contiguous())
        weights, idx = self.route(self.router(x))
        out = torch.zeros(T, self.hidden, dtype=torch.float32, device=x.device)
        flat = idx.flatten().cpu().numpy()
        order = np.argsort(flat, kind="stable")          # (token, slot) pairs by expert
        experts, starts = np.unique(flat[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        w = weights.flatten()
        for e, a, b in zip(experts.tolist(), starts.tolist(), ends.tolist()):
            pairs = torch.from_numpy(order[a:b]).to(x.device)
            tokens = pairs // self.top_k
            xe = x if T == 1 else x.index_select(0, tokens)
            y = self.experts[e](xe).float()
            out.index_add_(0, tokens, y * w.index_select(0, pairs)[:, None])
        return out.to(x.dtype)
