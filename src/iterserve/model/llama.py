"""The Llama family (llama, mistral, qwen2, qwen3) over a paged KV cache.

One module covers the family because the members differ only in small switches read from
ModelConfig: q/k/v bias (qwen2), per-head q/k RMSNorm (qwen3), sliding window (mistral), tied
embeddings, RoPE scaling. q/k/v and gate/up are fused into one GEMM each at load time.

forward() takes a flattened step (token ids + positions of all chunks, no padding) and returns
final hidden states; the runner applies `lm_head` only to the rows that sample.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model.attention import AttentionMetadata, paged_attention
from iterserve.model.config import ModelConfig, ModelLoadError
from iterserve.model import layers as layers_mod
from iterserve.model.kv_cache import PagedKVCache
from iterserve.model.layers import Linear, RMSNorm, RotaryEmbedding, apply_rope


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
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of a flattened step."""
        h = self.embed_tokens(input_ids)
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

    def use_fused_decode(self, on: bool = True) -> bool:
        """Run small decode-only steps through kernels.DecodeLayers (every layer in one call)
        or not; returns whether it is in use. It needs what that call chains: every layer
        Linear on the block kernel (use_quant), the native elementwise ops, and no bias but
        q/k/v's (Qwen2); q/k norm (Qwen3) is chained too. Anything else keeps the per-module
        path."""
        self._fused = None
        c = self.config
        attn = [layer.self_attn for layer in self.layers]
        linears = [m for layer in self.layers for m in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)]
        if not on or self.norm._native is None or any(m._qgemm is None for m in linears) \
                or any(m.bias is not None for m in linears if m not in
                       [x.qkv_proj for x in attn]):
            return False
        from iterserve.model import kernels

        def segments(linear: Linear) -> list[tuple[int, torch.Tensor]]:
            # legacy: BlockQuantWeight's split arrays back into GGUF blocks (a copy), until
            # the loader keeps the file's blocks and hands them over as segments
            w = linear.quant
            return [kernels.split_to_gguf_blocks(w.kind, w.qs, w.d, w.m)]

        specs = [kernels.LayerSpec(
            ln1=layer.input_layernorm.weight.detach(),
            ln2=layer.post_attention_layernorm.weight.detach(),
            qkv=segments(layer.self_attn.qkv_proj), o=segments(layer.self_attn.o_proj),
            gate_up=segments(layer.mlp.gate_up_proj), down=segments(layer.mlp.down_proj),
            qkv_bias=None if layer.self_attn.qkv_proj.bias is None
            else layer.self_attn.qkv_proj.bias.detach(),
            q_norm=None if layer.self_attn.q_norm is None
            else layer.self_attn.q_norm.weight.detach(),
            k_norm=None if layer.self_attn.k_norm is None
            else layer.self_attn.k_norm.weight.detach()) for layer in self.layers]
        if not kernels.DecodeLayers.supported(specs):
            return False
        a = attn[0]
        self._fused = kernels.DecodeLayers(specs, c.hidden_size, a.num_heads, a.num_kv_heads,
                                           a.head_dim, c.intermediate_size, c.rms_norm_eps)
        return True

    _fused = None          # kernels.DecodeLayers when in use

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # --- weights ---------------------------------------------------------------------------
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights, fusing q/k/v and gate/up. Missing or surplus tensors raise."""
        c = self.config
        sd = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ModelLoadError(f"weights lack tensor {name!r}")
            used.add(name)
            return sd[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(value.shape)}, "
                                     f"the config implies {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(value.to(param.dtype))

        put(self.embed_tokens.weight, take("embed_tokens.weight"), "embed_tokens.weight")
        put(self.norm.weight, take("norm.weight"), "norm.weight")
        if not c.tie_word_embeddings:
            put(self.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
        else:
            used.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            a = layer.self_attn
            put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm")
            put(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm")
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            put(a.qkv_proj.weight, qkv, p + "self_attn.qkv_proj.weight")
            if c.attention_bias:
                bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                put(a.qkv_proj.bias, bias, p + "self_attn.qkv_proj.bias")
            put(a.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            if c.qk_norm:
                put(a.q_norm.weight, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm")
                put(a.k_norm.weight, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            put(layer.mlp.gate_up_proj.weight, gate_up, p + "mlp.gate_up_proj.weight")
            put(layer.mlp.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
        surplus = [k for k in sd if k not in used and not re.search(r"rotary_emb|inv_freq", k)]
        if surplus:
            raise ModelLoadError(f"weights have tensors the {c.model_type} model does not use: "
                                 f"{surplus[:5]}{' ...' if len(surplus) > 5 else ''}")

    def attach_quantized(self, quantized: dict[str, "BlockQuantWeight"]) -> None:  # noqa: F821
        """Give each Linear the GGUF blocks of its weight (fused the way load_hf_state_dict
        fuses the floats); a fused Linear gets them only if all its parts have the same
        kind. `use_quant` turns them on."""
        from iterserve.model.quant import BlockQuantWeight
        q = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in quantized.items()}

        def attach(linear: Linear, names: list[str]) -> None:
            linear.quant = BlockQuantWeight.cat([q.get(n) for n in names])
            if linear.quant is not None and linear.quant.shape != tuple(linear.weight.shape):
                raise ModelLoadError(f"quantised {names} have shape {linear.quant.shape}, "
                                     f"the layer {tuple(linear.weight.shape)}")

        attach(self.lm_head, ["embed_tokens.weight" if self.config.tie_word_embeddings
                              else "lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attach(layer.self_attn.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"])
            attach(layer.self_attn.o_proj, [p + "self_attn.o_proj.weight"])
            attach(layer.mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            attach(layer.mlp.down_proj, [p + "mlp.down_proj.weight"])

    def use_quant(self, on: bool = True) -> bool:
        """Turn the native quantised kernel on (or off) for every Linear that has blocks;
        returns whether any uses it."""
        return any([m.use_quant(on) for m in self.modules() if isinstance(m, Linear)])

    def use_native_ops(self, on: bool = True) -> bool:
        """RMSNorm, SiLU x up and RoPE through the native elementwise kernels (kernels/elementwise.c)
        on CPU float32, or back to torch ops; returns whether they are in use."""
        from iterserve.model import kernels
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
