"""The RoPE tables of a decoder: one per layer type, over the rotary part of each head.

Why a module of its own: the families differ in which RoPE a layer gets, not in how it is
applied. Gemma 3's sliding layers use a local base (10k) where its global layers use 1M with
linear scaling; SmolLM3 has layers without RoPE; Phi-3 rotates only the first
`partial_rotary_factor` of each head and scales with LongRoPE (short factors, and long
factors once a sequence is past the pretraining length). Each table is
`layers.RotaryEmbedding` (or `LongRoPE`) built from the config with that layer type's base,
scaling and rotary width, so the frequencies are computed exactly as transformers does.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from iterserve.model.config import FULL, SLIDING, ModelConfig
from iterserve.model.layers import RotaryEmbedding


def _derived(config: ModelConfig, local: bool) -> ModelConfig:
    theta, scaling = config.rope_theta, config.rope_scaling
    if local and config.local_rope_theta is not None:
        theta, scaling = config.local_rope_theta, config.local_rope_scaling
    return dataclasses.replace(config, head_dim=config.rotary_dim, rope_theta=theta,
                               rope_scaling=scaling)


class LongRoPE(nn.Module):
    """Phi-3's LongRoPE: two frequency sets, short (a sequence within the pretraining
    length) and long (beyond it), both scaled by the same attention factor (HF's
    `_compute_longrope_parameters`). Which set a token uses is decided per token by the
    caller (`long` mask), as HF decides it per forward pass from the sequence's length."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        s = config.rope_scaling
        dim, base = config.head_dim, config.rope_theta
        orig = int(s["original_max_position_embeddings"])
        factor = s.get("factor") or config.max_position_embeddings / orig
        attn = s.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        self.original_max_position = orig
        self.attention_scaling = float(attn)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        for name in ("short", "long"):
            ext = torch.tensor(s[f"{name}_factor"], dtype=torch.float32)
            self.register_buffer(f"{name}_inv_freq", 1.0 / (ext * base ** shape), persistent=False)
            self.register_buffer(f"{name}_cos", torch.empty(0, dim), persistent=False)
            self.register_buffer(f"{name}_sin", torch.empty(0, dim), persistent=False)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.short_cos.shape[0], 256)
        pos = torch.arange(n, dtype=torch.float32)
        for name in ("short", "long"):
            freqs = pos[:, None] * getattr(self, f"{name}_inv_freq")[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            setattr(self, f"{name}_cos", emb.cos() * self.attention_scaling)
            setattr(self, f"{name}_sin", emb.sin() * self.attention_scaling)

    def forward(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype,
                long: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if max_position >= self.short_cos.shape[0]:
            self._grow(max_position + 1)
        cos = self.short_cos.index_select(0, positions)
        sin = self.short_sin.index_select(0, positions)
        if long is not None and bool(long.any()):
            sel = long[:, None]
            cos = torch.where(sel, self.long_cos.index_select(0, positions), cos)
            sin = torch.where(sel, self.long_sin.index_select(0, positions), sin)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def make_rotary(config: ModelConfig, local: bool = False) -> nn.Module:
    c = _derived(config, local)
    if c.rope_scaling and c.rope_scaling.get("rope_type") == "longrope":
        return LongRoPE(c)
    return RotaryEmbedding(c)


class Rotaries(nn.Module):
    """The model's tables: "global" always, "local" where sliding layers have their own RoPE.
    `layer_key(i)` says which a layer uses (None: a NoPE layer)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tables = nn.ModuleDict({"global": make_rotary(config)})
        self.local = config.local_rope_theta is not None and SLIDING in config.layer_types
        if self.local:
            self.tables["local"] = make_rotary(config, local=True)
        self.longrope = isinstance(self.tables["global"], LongRoPE)

    def layer_key(self, layer: int) -> str | None:
        c = self.config
        if not c.uses_rope(layer):
            return None
        if self.local and c.layer_types[layer] != FULL:
            return "local"
        return "global"

    def forward(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype,
                long: torch.Tensor | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for key, table in self.tables.items():
            if isinstance(table, LongRoPE):
                out[key] = table(positions, max_position, dtype, long)
            else:
                out[key] = table(positions, max_position, dtype)
        return out
