"""Building blocks shared by the architectures: RMSNorm, rotary embeddings, packed linear.

RoPE follows HF's "rotate_half" convention (weights are stored HF-style; the GGUF loader
un-permutes q/k), and the inverse frequencies are computed exactly as transformers does for
each `rope_type` a config can name, so logits match the reference to float32 rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model.config import ModelConfig, UnsupportedModelError
from iterserve.model.quant import BlockQuantWeight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    _native = None   # kernels.rmsnorm, set by the model's use_native_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native is not None and x.dtype == torch.float32 and x.is_contiguous() \
                and x.device.type == "cpu":
            return self._native(x, self.weight, self.eps, torch.empty_like(x))
        if x.dtype == torch.float32:            # fewest ops: this runs 2x per layer per step
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps)) * self.weight
        # Otherwise computed in float32 like HF, so bf16 keeps the reference's precision.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


# --- rotary embeddings ---------------------------------------------------------------------

def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention_scaling) for the config's rope type."""
    dim, base = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling: dict[str, Any] = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(scaling.get("factor", 1.0))
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(config, scaling, factor)
    raise UnsupportedModelError(
        f"rope_type {rope_type!r} is not supported (default, linear, llama3, yarn are)")


def _yarn_inv_freq(config: ModelConfig, s: dict[str, Any], factor: float) -> tuple[torch.Tensor, float]:
    dim, base = config.head_dim, config.rope_theta
    orig = s.get("original_max_position_embeddings") or config.max_position_embeddings

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = get_mscale(factor, s["mscale"]) / get_mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra_factor) + (1.0 / pos_freqs) * extra_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin looked up by position from a table grown on demand (float32, like HF)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_table", torch.empty(0, config.head_dim), persistent=False)
        self.register_buffer("sin_table", torch.empty(0, config.head_dim), persistent=False)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cos_table.shape[0], 256)
        pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = emb.cos() * self.attention_scaling
        self.sin_table = emb.sin() * self.attention_scaling

    def forward(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] for broadcasting over heads."""
        if max_position >= self.cos_table.shape[0]:
            self._grow(max_position + 1)
        cos = self.cos_table.index_select(0, positions).to(dtype)
        sin = self.sin_table.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; the HF rotate_half form."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# --- linear with prepacked weights ----------------------------------------------------------

# Row count up to which decode steps use the quantised kernel (and, with it, the fused decode
# layers of llama.py). On the default model the kernel is faster than oneDNN's float GEMM up to
# ~16 rows and level with it up to ~48 (both near this CPU's FMA peak there); at 24-32 rows the
# fused call's saved Python still made steps 3-10% faster in same-process A/B runs, at 48
# slower, hence 32.
QUANT_MAX_ROWS = 32


class Linear(nn.Module):
    """y = x W^T (+ b), optionally through a prepacked-weight GEMM on CPU float32.

    A decode step multiplies 1-64 rows by every weight. Plain sgemm is inefficient there: it
    re-packs the whole weight on every call. Two CPU libraries take a weight packed once:
    - "onednn": oneDNN's blocked layout (`torch.ops.mkldnn._linear_pointwise`, what inductor
      uses for frozen weights). oneDNN picks its kernels by the CPU's ISA at run time, so it
      is fast on AMD as well as Intel CPUs; one packed copy serves any row count.
    - "mkl": MKL's packed-B sgemm (`torch.ops.mkl._mkl_linear`). torch only takes the packed
      path when the row count equals its `prepack_batch_size` argument, but the buffer does not
      depend on that count (checked in tests), so we pass the actual row count.
    benchmarks/bench_decode.py measures all three side by side; see PACKING_DEFAULT in runner.py.

    A Linear loaded from a GGUF Q4_0/Q4_1/Q8_0 tensor also keeps those blocks (`quant`, see
    model/quant.py). With `use_quant` on (the runner's default on CPU), calls with at most
    QUANT_MAX_ROWS rows (decode steps, short prefill chunks) go through the native kernel,
    which streams ~0.6-1 byte per weight instead of 4; bigger calls (prefill chunks) keep the
    float GEMM, which is as fast once the row count amortises the weight reads.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._packed: torch.Tensor | None = None
        self._packing: str | None = None
        self.quant: BlockQuantWeight | None = None   # set by the model's GGUF weight loading
        self._qgemm = None                            # the native kernel when in use

    def use_quant(self, on: bool = True) -> bool:
        """Route small-row calls through the native block-quantised kernel; returns whether
        it is in use (it needs `quant`, float32 CPU weights and a built kernel)."""
        self._qgemm = None
        if on and self.quant is not None and self.weight.device.type == "cpu" \
                and self.weight.dtype == torch.float32:
            from iterserve.model import kernels
            self._qgemm = kernels.qgemm()
        return self._qgemm is not None

    def pack(self, mode: str | bool | None = "onednn") -> bool:
        """Make (or drop, with None/False) the packed copy; returns whether it is in use."""
        if mode is True:
            mode = "mkl"
        self._packed, self._packing = None, None
        if not mode or self.weight.device.type != "cpu" or self.weight.dtype != torch.float32:
            return False
        if mode not in packing_modes_available():
            return False
        w = self.weight.detach()
        if mode == "onednn":
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        else:
            self._packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 8)
        self._packing = mode
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._qgemm is not None and x.dim() == 2 and x.shape[0] <= QUANT_MAX_ROWS \
                and x.dtype == torch.float32:
            y = self.quant.matmul(x, self._qgemm, torch.get_num_threads())
            return y if self.bias is None else y.add_(self.bias)
        if self._packed is not None and x.dim() == 2 and x.dtype == torch.float32:
            if self._packing == "onednn":
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias,
                                                          "none", [], "")
            return torch.ops.mkl._mkl_linear(x.contiguous(), self._packed, self.weight,
                                             self.bias, x.shape[0])
        return F.linear(x, self.weight, self.bias)


def packing_modes_available() -> set[str]:
    modes = set()
    if mkl_packing_available():
        modes.add("mkl")
    try:
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            modes.add("onednn")
    except (AttributeError, RuntimeError):
        pass
    return modes


def mkl_packing_available() -> bool:
    try:
        return (torch.backends.mkl.is_available()
                and hasattr(torch.ops.mkl, "_mkl_linear")
                and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False
