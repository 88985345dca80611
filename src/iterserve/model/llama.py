"""The Llama family (llama, mistral, qwen2, qwen3) over a paged KV cache.

One module covers the family because the members differ only in small switches read from
ModelConfig: q/k/v bias (qwen2), per-head q/k RMSNorm (qwen3), sliding window (mistral), tied
embeddings, RoPE scaling. q/k/v and gate/up are fused into one GEMM each at load time, by
stacking their rows in the file's encoding (model/weights.py).

forward() takes a flattened step (token ids + positions of all chunks, no padding) and returns
final hidden states; the runner applies `lm_head` only to the rows that sample.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.errors import ModelLoadError
from iterserve.model.attention import AttentionMetadata, paged_attention
from iterserve.model.config import ModelConfig
from iterserve.model import kernels, layers as layers_mod
from iterserve.model.kv_cache import PagedKVCache
from iterserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, apply_rope


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = Linear(self.q_size, c.hidden_size)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.scale = c.head_dim ** -0.5

    _rope = None      # kernels.rope, set by the model's use_native_ops
    _qk_norm = None   # kernels.qk_norm, likewise

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_slots: torch.Tensor, v_slots: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self._rope is not None and qkv.dtype == torch.float32 and qkv.is_contiguous() \
                and cos.is_contiguous() and sin.is_contiguous():
            # in place on the q and k heads of this step's own qkv buffer (q/k norm first)
            if self.q_norm is not None:
                self._qk_norm(qkv, H, self.num_kv_heads, self.head_dim, self.q_norm.weight,
                              self.k_norm.weight, self.q_norm.eps)
            self._rope(qkv, H + self.num_kv_heads, self.head_dim, cos, sin)
            q = qkv[:, :self.q_size].view(T, H, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads,
                                                                    self.head_dim)
        elif self.q_norm is None:
            # q and k heads side by side: one RoPE over both halves the op count.
            qk = qkv[:, :self.q_size + self.kv_size].view(T, H + self.num_kv_heads, self.head_dim)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(T, H, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size]
                            .view(T, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, k_slots, v_slots, meta, self.scale)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.inter = c.intermediate_size
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size)

    _native = None   # kernels.silu_mul, set by the model's use_native_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if self._native is not None and gu.dtype == torch.float32 and gu.is_contiguous() \
                and gu.device.type == "cpu":
            return self.down_proj(self._native(gu, torch.empty(gu.shape[0], self.inter)))
        gate, up = gu.split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # computed on CPU even when the model is built on the meta device: meta tensors run
        # torch's Python reference kernels, whose first use imported for ~8 s (measured)
        with torch.device("cpu"):
            self.rotary = RotaryEmbedding(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            if self.embed_tokens.encoded is not None:
                self.lm_head.set_weight(self.embed_tokens.encoded)   # the same blocks
            else:
                self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of a flattened step."""
        h = self.embed_tokens(input_ids, self.config.dtype)
        cos, sin = self.rotary(positions, max_position, h.dtype)
        T = h.shape[0]
        if self._fused is not None and meta.num_decodes == T and T <= layers_mod.QUANT_MAX_ROWS \
                and meta.decode_kernel is not None:
            self._decode_layers(h, cos, sin, kv_cache, meta)
            return self.norm(h)
        for i, layer in enumerate(self.layers):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin,
                                    kv_cache.k_slots[i], kv_cache.v_slots[i], meta)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def _decode_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: PagedKVCache, meta: AttentionMetadata) -> None:
        """All layers of a decode-only step in one native call, h updated in place."""
        a = self.layers[0].self_attn
        self._fused.run(h, cos.contiguous(), sin.contiguous(), meta.slot_mapping.contiguous(),
                        meta.decode_tables, meta.decode_lens, meta.sliding_window,
                        meta.block_size, a.scale, kv_cache.k_slots, kv_cache.v_slots)

    def decode_layer_specs(self) -> list | None:
        """One `kernels.LayerSpec` per layer from the Linears' encoded segments (None when
        the kernels are missing or a layer's weights are not all encoded)."""
        if not hasattr(kernels, "LayerSpec"):
            return None
        specs = []
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(m.encoded is None for m in linears) or a.o_proj.bias is not None:
                return None
            qkv, o, gu, down = (list(m.encoded.segments) for m in linears)
            specs.append(kernels.LayerSpec(
                ln1=layer.input_layernorm.weight.detach(),
                ln2=layer.post_attention_layernorm.weight.detach(),
                qkv=qkv, o=o, gate_up=gu, down=down,
                qkv_bias=None if a.qkv_proj.bias is None else a.qkv_proj.bias.detach(),
                q_norm=None if a.q_norm is None else a.q_norm.weight.detach(),
                k_norm=None if a.k_norm is None else a.k_norm.weight.detach()))
        return specs

    def use_fused_decode(self, on: bool = True) -> bool:
        """Run small decode-only steps through `kernels.DecodeLayers` (every layer in one
        call) or not; returns whether it is in use. It needs every layer Linear on the
        native GEMM (use_quant), the native elementwise ops, and a spec the kernels accept
        (`DecodeLayers.supported`); anything else keeps the per-module path."""
        self._fused = None
        c = self.config
        attn = [layer.self_attn for layer in self.layers]
        linears = [m for layer in self.layers for m in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)]
        if not on or self.norm._native is None or c.dtype != torch.float32 \
                or any(m.compute_path() != "native" for m in linears):
            return False
        specs = self.decode_layer_specs()
        if specs is None or not hasattr(kernels, "DecodeLayers") \
                or not kernels.DecodeLayers.supported(specs):
            return False
        self._fused = kernels.DecodeLayers(specs, c.hidden_size, c.num_heads, c.num_kv_heads,
                                           c.head_dim, c.intermediate_size, c.rms_norm_eps)
        return True

    _fused = None          # kernels.DecodeLayers when in use

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # --- weights ---------------------------------------------------------------------------
    def load_weights(self, refs: dict, place) -> None:
        """Install HF-named tensors (`weights.TensorRef`s) through `place` (loader.Placement:
        encoded on CPU, dense on CUDA or when a dtype was asked for), fusing q/k/v and
        gate/up by stacking their rows. Missing or surplus tensors raise ModelLoadError."""
        c = self.config
        refs = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in refs.items()}
        used: set[str] = set()

        def take(name: str):
            if name not in refs:
                raise ModelLoadError(f"weights lack tensor {name!r}")
            used.add(name)
            return refs[name]

        def vector(module: nn.Module, attr: str, name: str, size: int) -> None:
            ref = take(name)
            if tuple(ref.shape) != (size,):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(ref.shape)}, "
                                     f"the config implies {(size,)}")
            setattr(module, attr, nn.Parameter(place.vector(ref), requires_grad=False))

        def matrix(module, names: list[str], what: str) -> None:
            parts = [take(n) for n in names]
            try:
                module.set_weight(place.matrix(parts))
            except ValueError as e:
                raise ModelLoadError(f"{what}: {e}") from None

        matrix(self.embed_tokens, ["embed_tokens.weight"], "embed_tokens")
        vector(self.norm, "weight", "norm.weight", c.hidden_size)
        if c.tie_word_embeddings:
            used.add("lm_head.weight")
            self.tie_weights()
        else:
            matrix(self.lm_head, ["lm_head.weight"], "lm_head")
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            a = layer.self_attn
            vector(layer.input_layernorm, "weight", p + "input_layernorm.weight", c.hidden_size)
            vector(layer.post_attention_layernorm, "weight",
                   p + "post_attention_layernorm.weight", c.hidden_size)
            matrix(a.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"], p + "qkv_proj")
            if c.attention_bias:
                bias = torch.cat([place.vector(take(p + f"self_attn.{n}_proj.bias")) for n in "qkv"])
                if bias.shape != (a.q_size + 2 * a.kv_size,):
                    raise ModelLoadError(f"{p}self_attn q/k/v biases have {bias.shape[0]} "
                                         f"values, the config implies {a.q_size + 2 * a.kv_size}")
                a.qkv_proj.bias = nn.Parameter(bias, requires_grad=False)
            matrix(a.o_proj, [p + "self_attn.o_proj.weight"], p + "o_proj")
            if c.qk_norm:
                vector(a.q_norm, "weight", p + "self_attn.q_norm.weight", c.head_dim)
                vector(a.k_norm, "weight", p + "self_attn.k_norm.weight", c.head_dim)
            matrix(layer.mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                   p + "gate_up_proj")
            matrix(layer.mlp.down_proj, [p + "mlp.down_proj.weight"], p + "down_proj")
        surplus = [k for k in refs if k not in used and not re.search(r"rotary_emb|inv_freq", k)]
        if surplus:
            raise ModelLoadError(f"weights have tensors the {c.model_type} model does not use: "
                                 f"{surplus[:5]}{' ...' if len(surplus) > 5 else ''}")

    def use_quant(self, on: bool = True) -> bool:
        """Turn the native GEMM over encoded blocks on (or off) for every Linear whose
        segment types have one; returns whether any uses it."""
        return any([m.use_quant(on) for m in self.modules() if isinstance(m, Linear)])

    def use_native_ops(self, on: bool = True) -> bool:
        """RMSNorm, SiLU x up and RoPE through the native elementwise kernels (kernels/elementwise.c)
        on CPU float32, or back to torch ops; returns whether they are in use."""
        native = on and self.norm.weight.device.type == "cpu" \
            and self.norm.weight.dtype == torch.float32 and kernels.available()
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m._native = kernels.rmsnorm if native else None
            elif isinstance(m, MLP):
                m._native = kernels.silu_mul if native else None
            elif isinstance(m, Attention):
                m._rope = kernels.rope if native else None
                m._qk_norm = kernels.qk_norm if native else None
        return native

    def pack_linears(self, mode: str | bool | None = "onednn") -> bool:
        """Switch every Linear (the lm_head included) to prepacked weights ("onednn" or
        "mkl", see layers.Linear) or back to plain ones (None)."""
        return all([m.pack(mode) for m in self.modules() if isinstance(m, Linear)])
