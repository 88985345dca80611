"""Building blocks shared by the architectures: RMSNorm, rotary embeddings, Linear and
Embedding over weights kept in their file's encoding (model/weights.py).

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

from iterserve.errors import UnsupportedModelError
from iterserve.model import kernels
from iterserve.model.config import ModelConfig
from iterserve.model.weights import EncodedWeight, decode_rows, scratch, tile_rows


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


# --- linear over encoded or dense weights --------------------------------------------------

# Row count up to which calls use the native GEMM over encoded blocks (and, with it, the fused
# decode layers of llama.py). On the default model the Q4 kernel is faster than oneDNN's float
# GEMM up to ~16 rows and level with it up to ~48; at 24-32 rows the fused call's saved Python
# still made steps 3-10% faster in same-process A/B runs, at 48 slower, hence 32.
QUANT_MAX_ROWS = 32

# Under `--kernel-activations auto` the LM head does not take plain int8 activations: its
# logits are what sampling reads directly, and rounding its input rows to 8 bits was a third
# of the whole model's divergence from the float path. benchmarks/accuracy.py on the bundled
# Q4_1 model, three texts, ~2,900 positions, teacher-forced decode steps: the top-k KL to the
# float path 0.00199 -> 0.00141 with the head in float (llama-server on the same file:
# 0.00191), top-1 agreement 0.961 -> 0.967, on AVX-512 VNNI (AVX2: 0.00204 -> 0.00138,
# llama-server 0.00221); the first layer in float as well bought 0.00141 -> 0.00130 for
# +60-85% per step, so only the head. The float kernels are bound by instructions, though,
# and a big head at batch 1 is a large part of a step (a Q6_K head was 45% of a Qwen3-MoE
# step), so the head runs split activations (kernels.qgemm_split8, qdot8.c): each row as
# its 8-bit rounding plus the rounding's residual in 8 bits, ~1/250 of int8's rounding error
# at the int8 kernels' speed where dispatch.c measured it faster (K-quant heads up to 16 rows:
# 1.3-3.5x the float kernels; 32-element types up to 2); float elsewhere. Its accuracy and
# cost beside the float head: the lm_head_float variant of benchmarks/accuracy.py.
LM_HEAD_AUTO_ACTIVATIONS = "split8"


def _kernels():
    """The native kernels module when it has the GGUF-native API (qgemm over file blocks)."""
    if not hasattr(kernels, "supports_qgemm") or not kernels.available():
        return None
    return kernels


class Linear(nn.Module):
    """y = x W^T (+ b) over a weight that is either dense (a float tensor) or encoded.

    Encoded (`encoded`, a weights.EncodedWeight: GGUF blocks or bf16/fp16 rows, row segments
    in their file's encoding): each segment computes its slice of the output columns.
    - native: `kernels.qgemm` reads the blocks directly (dequantising in registers) when the
      segment's type has a kernel and the call has at most QUANT_MAX_ROWS rows (decode steps):
      there a step is bound by the bytes of weights it streams.
    - prefill: calls with more rows (prefill chunks, large batches) use `kernels.gemm`, for
      every type `kernels.dequant` decodes: panels of 32 weight rows decoded into an L1
      scratch and multiplied by all rows in a register-blocked float32 micro-kernel, so the
      decode cost is shared by the rows (kernels/prefill.c).
    - reference: otherwise (no native library, kernels switched off, a type it cannot decode)
      a tile of rows is widened to float32 into a few-MB scratch (weights.TILE_BYTES) and
      multiplied with a float GEMM into the output slice, tile after tile: never a float
      copy of the matrix.
    Dense (`weight`): float checkpoints in their own dtype (fp32 rows of a GGUF or an HF
    directory, a dtype the user asked for, CUDA). Plain sgemm re-packs the weight on every
    call, so on CPU float32 it may be prepacked once (`pack`): oneDNN's blocked layout
    (`torch.ops.mkldnn._linear_pointwise`, what inductor uses for frozen weights) or MKL's
    packed sgemm; benchmarks/bench_decode.py measures them. Packing is a copy of the weight,
    so it is only done for weights that are float32 in the checkpoint itself.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 auto_activations: str = "auto") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # The mode this layer's native calls run under while the process's is "auto"
        # ("split8": the LM head, LM_HEAD_AUTO_ACTIVATIONS); "float" and "int8" set by the
        # user apply to every layer.
        self.auto_activations = auto_activations
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.encoded: EncodedWeight | None = None
        self._packed: torch.Tensor | None = None
        self._packing: str | None = None
        self._native: frozenset[int] = frozenset()   # segment types run by kernels.qgemm
        self._panel: frozenset[int] = frozenset()    # segment types run by kernels.gemm

    @property
    def quant(self) -> EncodedWeight | None:
        """The encoded weight (None for a dense one)."""
        return self.encoded

    @property
    def _qgemm(self):
        """Truthy when some segment runs on the native kernel."""
        return self._native or None

    def set_weight(self, w: "EncodedWeight | torch.Tensor") -> None:
        """Install the weight: an EncodedWeight (one F32 segment becomes a dense zero-copy
        view of it) or a dense tensor."""
        if isinstance(w, EncodedWeight):
            if w.shape != (self.out_features, self.in_features):
                raise ValueError(f"weight {w.names} has shape {w.shape}, the layer "
                                 f"{(self.out_features, self.in_features)}")
            dense = w.dense_f32()
            if dense is None:
                self.weight, self.encoded = None, w
                self._packed = self._packing = None
                self._native = self._panel = frozenset()
                return
            w = dense
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight has shape {tuple(w.shape)}, the layer "
                             f"{(self.out_features, self.in_features)}")
        self.weight = nn.Parameter(w, requires_grad=False)
        self.encoded = None
        self._native = self._panel = frozenset()

    def use_quant(self, on: bool = True) -> bool:
        """Route small-row calls of encoded segments through the native decode GEMM where
        their type has one, and larger calls through the native prefill GEMM (every type
        `kernels.dequant` decodes); returns whether any segment of this Linear uses the
        decode GEMM."""
        self._native = self._panel = frozenset()
        if on and self.encoded is not None and self.encoded.segments[0][1].device.type == "cpu":
            k = _kernels()
            if k is not None and self.in_features % 32 == 0:
                self._native = frozenset(t for t in self.encoded.types if k.supports_qgemm(t))
                if hasattr(k, "gemm"):
                    self._panel = frozenset(t for t in self.encoded.types
                                            if k.supports_dequant(t))
        return bool(self._native)

    def compute_path(self) -> str:
        """'native' (every segment on the native GEMM at decode row counts), 'mixed',
        'reference' (tiles widened to float32) or 'dense'."""
        if self.encoded is None:
            return "dense"
        n = sum(t in self._native for t in self.encoded.types)
        return "native" if n == len(self.encoded.segments) else ("mixed" if n else "reference")

    def pack(self, mode: str | bool | None = "onednn") -> bool:
        """Make (or drop, with None/False) the packed copy; returns whether it is in use."""
        if mode is True:
            mode = "mkl"
        self._packed, self._packing = None, None
        if not mode or self.weight is None or self.weight.device.type != "cpu" \
                or self.weight.dtype != torch.float32:
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
        if self.encoded is not None:
            return self._encoded_forward(x)
        if self._packed is not None and x.dim() == 2 and x.dtype == torch.float32:
            if self._packing == "onednn":
                return onednn_linear(x.contiguous(), self._packed, self.bias)
            return torch.ops.mkl._mkl_linear(x.contiguous(), self._packed, self.weight,
                                             self.bias, x.shape[0])
        return F.linear(x, self.weight, self.bias)

    def _encoded_forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], self.in_features
        xf = x.reshape(-1, k)
        if xf.dtype != torch.float32 or not xf.is_contiguous():
            xf = xf.float().contiguous()
        m = xf.shape[0]
        native = self._native if m <= QUANT_MAX_ROWS else frozenset()
        panel = self._panel if m > QUANT_MAX_ROWS else frozenset()
        segments = self.encoded.segments
        if len(segments) == 1 and segments[0][0] not in native and segments[0][0] not in panel \
                and self.out_features <= tile_rows(k):
            t, w = segments[0]                      # one tile: the GEMM's result is the output
            out = _float_mm(xf, decode_rows(t, w, k, scratch(w.shape[0], k)))
        else:
            out = torch.empty(m, self.out_features, dtype=torch.float32, device=xf.device)
            kern = _kernels() if native or panel else None
            act = None
            if kern is not None and self.auto_activations != "auto" \
                    and kern.activations() == "auto":
                act = self.auto_activations
            col = 0
            for t, w in segments:
                if t in native:
                    kern.qgemm(t, w, k, xf, out, col, act)
                elif t in panel:
                    kern.gemm(t, w, k, xf, out, col, act)
                else:
                    self._reference(t, w, xf, out, col)
                col += w.shape[0]
        if self.bias is not None:
            out.add_(self.bias)
        if x.dtype != torch.float32:
            out = out.to(x.dtype)
        return out.view(*lead, self.out_features)

    def _reference(self, t: int, w: torch.Tensor, xf: torch.Tensor, out: torch.Tensor,
                   col: int) -> None:
        """out[:, col:col+n] = xf @ W_seg^T, one bounded float32 tile of rows at a time."""
        n, k = w.shape[0], self.in_features
        step = tile_rows(k)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            tile = decode_rows(t, w[r0:r1], k, scratch(r1 - r0, k))
            out[:, col + r0:col + r1] = _float_mm(xf, tile)


def _float_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T for float32 CPU tensors. oneDNN takes a plain (unpacked) weight too and was
    ~2x faster than torch.mm (MKL sgemm) at 64-256 rows on this AMD CPU (same process, best
    of 30, under load), so the reference path's tiles go through it where torch has it."""
    if _ONEDNN_PLAIN and x.device.type == "cpu":
        return onednn_linear(x, w, None)
    return torch.mm(x, w.t())


# oneDNN (and ideep in front of it) caches one primitive per GEMM shape, in LRU caches of
# 1024 entries each (ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY), ~0.3 MB apiece here
# (JIT code, descriptors, scratch): a prefill step's row count is the batch's token count, so
# a server meeting every row count grew its heap by ~0.6 MB per new shape until ~1,000 shapes
# per cache, 100+ MB/min at first (a soak measured it). Calls are therefore made in a bounded
# set of row counts: exact up to ONEDNN_EXACT_ROWS (decode batches, where padding would cost),
# padded to a multiple of ONEDNN_ROW_STEP up to ONEDNN_MAX_ROWS, and in ONEDNN_MAX_ROWS-row
# pieces beyond: at most 31 shapes per weight, whatever the traffic.
ONEDNN_EXACT_ROWS = 16
ONEDNN_ROW_STEP = 16
ONEDNN_MAX_ROWS = 256
_onednn_op = None           # torch.ops.mkldnn._linear_pointwise unless replaced (tests count shapes)


def onednn_rows(m: int) -> list[tuple[int, int, int]]:
    """(start, rows, rows as computed) of the pieces `onednn_linear` splits m rows into."""
    pieces = []
    for r0 in range(0, m, ONEDNN_MAX_ROWS):
        rows = min(ONEDNN_MAX_ROWS, m - r0)
        padded = rows if rows <= ONEDNN_EXACT_ROWS else -(-rows // ONEDNN_ROW_STEP) * ONEDNN_ROW_STEP
        pieces.append((r0, rows, padded))
    return pieces


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] (float32, contiguous) @ w^T (+ bias) by oneDNN, in bounded row shapes (see
    above). `w` is plain [n, k] or prepacked by `_reorder_linear_weight`."""
    op = _onednn_op or torch.ops.mkldnn._linear_pointwise
    m = x.shape[0]
    pieces = onednn_rows(m)
    if len(pieces) == 1 and pieces[0][2] == m:
        return op(x, w, bias, "none", [], "")
    out = None
    for r0, rows, padded in pieces:
        xs = x[r0:r0 + rows]
        if padded != rows:
            xp = x.new_zeros(padded, x.shape[1])
            xp[:rows] = xs
            xs = xp
        y = op(xs, w, bias, "none", [], "")
        if out is None:
            out = x.new_empty(m, y.shape[1])
        out[r0:r0 + rows] = y[:rows]
    return out


class Embedding(nn.Module):
    """Token embedding over a dense or an encoded table: a lookup decodes only the rows it
    looks up, and a tied LM head shares the same table (no second copy)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.encoded: EncodedWeight | None = None

    def set_weight(self, w: "EncodedWeight | torch.Tensor") -> None:
        if isinstance(w, EncodedWeight):
            if w.shape != (self.num_embeddings, self.embedding_dim):
                raise ValueError(f"embedding {w.names} has shape {w.shape}, the model "
                                 f"{(self.num_embeddings, self.embedding_dim)}")
            dense = w.dense_f32()
            if dense is None:
                self.weight, self.encoded = None, w
                return
            w = dense
        self.weight = nn.Parameter(w, requires_grad=False)
        self.encoded = None

    def forward(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.encoded is None:
            return F.embedding(ids, self.weight)
        out = self.encoded.lookup(ids.cpu())
        return out.to(dtype).view(*ids.shape, self.embedding_dim)


def packing_modes_available() -> set[str]:
    """The prepacked-weight GEMMs this torch build offers ("mkl", "onednn")."""
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


_ONEDNN_PLAIN = "onednn" in packing_modes_available()
