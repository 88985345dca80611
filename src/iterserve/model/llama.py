"""The decoder every supported family runs on, over a paged KV cache.

One module covers llama, mistral, qwen2, qwen3, granite, smollm3, phi3, gemma2, gemma3 and the
Mixture-of-Experts qwen3_moe, mixtral and gpt-oss, because they differ only in switches read
from ModelConfig (model/config.py sets them per family, as vLLM and HF describe families by
config): q/k/v and o biases, per-head q/k RMSNorm, a sliding window per layer, layers without
RoPE, partial rotary, RoPE per layer type (model/rotary.py), Gemma's norms around attention
and MLP and its (1 + w) norm weights, multipliers on embeddings / residuals / logits, soft-caps
on attention scores and logits, attention sinks, GeGLU, and expert layers (model/moe.py) in
place of the dense MLP. q/k/v and gate/up are fused into one GEMM each at load time, by
stacking their rows in the file's encoding (model/weights.py); the checkpoint's names are
mapped to this module's by model/weight_names.py.

forward() takes a flattened step (token ids + positions of all chunks, no padding) and returns
final hidden states; the runner applies `logits` only to the rows that sample.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.errors import ModelLoadError
from iterserve.model import kernels, layers as layers_mod
from iterserve.model.attention import AttentionMetadata, for_window, native_step, paged_attention
from iterserve.model.attention_eager import eager_paged_attention
from iterserve.model.config import ModelConfig
from iterserve.model.kv_cache import PagedKVCache
from iterserve.model.layers import LM_HEAD_AUTO_ACTIVATIONS, Embedding, Linear, RMSNorm, apply_rope
from iterserve.model.moe import Expert, SparseMoE
from iterserve.model.rotary import Rotaries


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=c.o_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.scale = c.attention_scale if c.attention_scale is not None else c.head_dim ** -0.5
        self.window = c.window_of(layer)
        self.rotary_dim = c.rotary_dim
        self.softcap = c.attn_logit_softcapping
        self.sinks = nn.Parameter(torch.zeros(c.num_heads)) if c.attention_sinks else None

    _rope = None      # kernels.rope, set by the model's use_native_ops
    _qk_norm = None   # kernels.qk_norm, likewise

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                k_slots: torch.Tensor, v_slots: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """rope: this layer's (cos, sin) [T, 1, rotary_dim], or None for a layer without RoPE."""
        T, H = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        full = rope is not None and self.rotary_dim == self.head_dim
        if self._rope is not None and qkv.dtype == torch.float32 and qkv.is_contiguous() \
                and (rope is None or (full and rope[0].is_contiguous() and rope[1].is_contiguous())):
            # in place on the q and k heads of this step's own qkv buffer (q/k norm first)
            if self.q_norm is not None:
                self._qk_norm(qkv, H, self.num_kv_heads, self.head_dim, self.q_norm.weight,
                              self.k_norm.weight, self.q_norm.eps)
            if rope is not None:
                self._rope(qkv, H + self.num_kv_heads, self.head_dim, rope[0], rope[1])
            q = qkv[:, :self.q_size].view(T, H, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads,
                                                                    self.head_dim)
        else:
            qk = qkv[:, :self.q_size + self.kv_size].view(T, H + self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
            if rope is not None:
                # q and k heads side by side: one RoPE over both halves the op count.
                qk = _rotate(qk, rope[0], rope[1], self.rotary_dim)
            q, k = qk[:, :H], qk[:, H:]
        m = for_window(meta, self.window)
        if self.softcap is None and self.sinks is None:
            o = paged_attention(q, k, v, k_slots, v_slots, m, self.scale)
        elif self.softcap is None and q.dtype == torch.float32 and native_step(m):
            o = paged_attention(q, k, v, k_slots, v_slots, m, self.scale,
                                sinks=self.sinks.detach().float().contiguous())
        else:
            o = eager_paged_attention(q, k, v, k_slots, v_slots, m, self.scale, self.softcap,
                                      self.sinks)
        return self.o_proj(o.reshape(T, self.q_size))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """RoPE on the first `rot` dims of each head (all of them in most families)."""
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.inter = c.intermediate_size
        self.act = c.hidden_act
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    _native = None   # kernels.silu_mul, set by the model's use_native_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if self.act == "silu" and self._native is not None and gu.dtype == torch.float32 \
                and gu.is_contiguous() and gu.device.type == "cpu":
            return self.down_proj(self._native(gu, torch.empty(gu.shape[0], self.inter)))
        gate, up = gu.split([self.inter, self.inter], dim=-1)
        if self.act == "gelu_pytorch_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP (or experts). `post_attention_layernorm` is the norm before
    the MLP (Llama's name); Gemma's norms on the attention and MLP outputs are
    `post_attn_norm` / `post_ffn_norm`."""

    def __init__(self, c: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoE(c) if c.is_moe(layer) else MLP(c)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.sandwich_norms else None
        self.post_ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.sandwich_norms else None
        self.residual_multiplier = c.residual_multiplier

    def forward(self, h: torch.Tensor, rope, k_slots, v_slots, meta) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), rope, k_slots, v_slots, meta)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        if self.residual_multiplier != 1.0:
            a = a * self.residual_multiplier
        h = h + a
        m = self.mlp(self.post_attention_layernorm(h))
        if self.post_ffn_norm is not None:
            m = self.post_ffn_norm(m)
        if self.residual_multiplier != 1.0:
            m = m * self.residual_multiplier
        return h + m


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # computed on CPU even when the model is built on the meta device: meta tensors run
        # torch's Python reference kernels, whose first use imported for ~8 s (measured)
        with torch.device("cpu"):
            self.rotary = Rotaries(config)
        self.rope_keys = [self.rotary.layer_key(i) for i in range(config.num_layers)]
        self.lm_head = Linear(config.hidden_size, config.vocab_size,
                              auto_activations=LM_HEAD_AUTO_ACTIVATIONS)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            if self.embed_tokens.encoded is not None:
                self.lm_head.set_weight(self.embed_tokens.encoded)   # the same blocks
            else:
                self.lm_head.weight = self.embed_tokens.weight

    def make_rotary(self, device: torch.device) -> None:
        """(Re)compute the RoPE tables on `device` (buffers are computed, never loaded)."""
        self.rotary = Rotaries(self.config).to(device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of a flattened step."""
        c = self.config
        h = self.embed_tokens(input_ids, c.dtype)
        if c.embedding_multiplier != 1.0:
            h = h * torch.tensor(c.embedding_multiplier, dtype=h.dtype)
        long = _long_rope_rows(positions, meta, self.rotary) if self.rotary.longrope else None
        ropes = self.rotary(positions, max_position, h.dtype, long)
        T = h.shape[0]
        if self._fused is not None and meta.num_decodes == T and T <= layers_mod.QUANT_MAX_ROWS \
                and meta.decode_kernel is not None:
            cos, sin = ropes["global"]
            self._decode_layers(h, cos, sin, kv_cache, meta)
            return self.norm(h)
        for i, layer in enumerate(self.layers):
            key = self.rope_keys[i]
            h = layer(h, None if key is None else ropes[key], kv_cache.k_slots[i],
                      kv_cache.v_slots[i], meta)
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
        the kernels are missing, the layers do not fit the fused call
        (`ModelConfig.decode_layers_fit`, one RoPE table for all), or a layer's weights are
        not all encoded)."""
        if not hasattr(kernels, "LayerSpec") or not self.config.decode_layers_fit \
                or any(k != self.rope_keys[0] for k in self.rope_keys):
            return None
        specs = []
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            moe = isinstance(mlp, SparseMoE)
            if moe and mlp._block is None:
                return None
            linears = (a.qkv_proj, a.o_proj) if moe else \
                (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(m.encoded is None for m in linears):
                return None
            qkv, o = (list(m.encoded.segments) for m in linears[:2])
            gu, down = (None, None) if moe else (list(m.encoded.segments) for m in linears[2:])
            specs.append(kernels.LayerSpec(
                ln1=layer.input_layernorm.weight.detach(),
                ln2=layer.post_attention_layernorm.weight.detach(),
                qkv=qkv, o=o, gate_up=gu, down=down, moe=mlp._block if moe else None,
                qkv_bias=None if a.qkv_proj.bias is None else a.qkv_proj.bias.detach(),
                q_norm=None if a.q_norm is None else a.q_norm.weight.detach(),
                k_norm=None if a.k_norm is None else a.k_norm.weight.detach(),
                o_bias=None if a.o_proj.bias is None else a.o_proj.bias.detach(),
                sinks=None if a.sinks is None else a.sinks.detach(),
                window=a.window or 0))
        return specs

    def use_fused_decode(self, on: bool = True) -> bool:
        """Run small decode-only steps through `kernels.DecodeLayers` (every layer in one
        call) or not; returns whether it is in use. It needs plain Llama layers or gpt-oss's
        (`ModelConfig.decode_layers_fit`), every layer Linear on the native GEMM (use_quant), the
        native elementwise ops, and a spec the kernels accept (`DecodeLayers.supported`);
        anything else keeps the per-module path."""
        self._fused = None
        c = self.config
        if not on or not c.decode_layers_fit or self.norm._native is None \
                or c.dtype != torch.float32:
            return False
        linears = [m for layer in self.layers for m in (
            (layer.self_attn.qkv_proj, layer.self_attn.o_proj) if isinstance(layer.mlp, SparseMoE)
            else (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                  layer.mlp.down_proj))]
        if any(m.compute_path() != "native" for m in linears):
            return False         # (an MoE layer's experts: decode_layer_specs checks its block)
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
        c = self.config
        out = self.lm_head(hidden).float()
        if c.logits_scaling != 1.0:
            out = out / c.logits_scaling
        if c.final_logit_softcapping is not None:
            cap = c.final_logit_softcapping
            out = torch.tanh(out / cap) * cap
        return out

    # --- weights ---------------------------------------------------------------------------
    def load_weights(self, refs: dict, place) -> None:
        """Install checkpoint tensors (`weights.TensorRef`s, named as model/weight_names.py
        maps each family's names) through `place` (loader.Placement: encoded on CPU, dense on
        CUDA or when a dtype was asked for), fusing q/k/v and gate/up by stacking their rows.
        Missing or surplus tensors raise ModelLoadError."""
        from iterserve.model.weight_names import canonical_refs
        c = self.config
        refs = canonical_refs(refs, c)
        used: set[str] = set()

        def take(name: str):
            if name not in refs:
                raise ModelLoadError(f"weights lack tensor {name!r}")
            used.add(name)
            return refs[name]

        def vector(module: nn.Module, attr: str, name: str, size: int, offset: float = 0.0):
            ref = take(name)
            if tuple(ref.shape) != (size,):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(ref.shape)}, "
                                     f"the config implies {(size,)}")
            t = place.vector(ref)
            if offset:
                t = t + offset
            setattr(module, attr, nn.Parameter(t, requires_grad=False))

        def norm(module: RMSNorm, name: str, size: int) -> None:
            vector(module, "weight", name, size, c.norm_weight_offset)

        def matrix(module, names: list[str], what: str, copy: bool = True) -> None:
            parts = [take(n) for n in names]
            try:
                module.set_weight(place.matrix(parts, copy=copy))
            except ValueError as e:
                raise ModelLoadError(f"{what}: {e}") from None

        def bias(module: Linear, names: list[str], what: str) -> None:
            b = torch.cat([place.vector(take(n)).flatten() for n in names])
            if b.shape != (module.out_features,):
                raise ModelLoadError(f"{what} has {b.shape[0]} values, the config implies "
                                     f"{module.out_features}")
            module.bias = nn.Parameter(b, requires_grad=False)

        matrix(self.embed_tokens, ["embed_tokens.weight"], "embed_tokens")
        norm(self.norm, "norm.weight", c.hidden_size)
        if c.tie_word_embeddings:
            used.add("lm_head.weight")
            self.tie_weights()
        else:
            matrix(self.lm_head, ["lm_head.weight"], "lm_head")
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            a = layer.self_attn
            norm(layer.input_layernorm, p + "input_layernorm.weight", c.hidden_size)
            norm(layer.post_attention_layernorm, p + "post_attention_layernorm.weight",
                 c.hidden_size)
            if c.sandwich_norms:
                norm(layer.post_attn_norm, p + "post_attn_norm.weight", c.hidden_size)
                norm(layer.post_ffn_norm, p + "post_ffn_norm.weight", c.hidden_size)
            matrix(a.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"], p + "qkv_proj")
            if c.attention_bias:
                bias(a.qkv_proj, [p + f"self_attn.{n}_proj.bias" for n in "qkv"],
                     f"{p}self_attn q/k/v biases")
            matrix(a.o_proj, [p + "self_attn.o_proj.weight"], p + "o_proj")
            if c.o_bias:
                bias(a.o_proj, [p + "self_attn.o_proj.bias"], f"{p}self_attn.o_proj.bias")
            if c.qk_norm:
                norm(a.q_norm, p + "self_attn.q_norm.weight", c.head_dim)
                norm(a.k_norm, p + "self_attn.k_norm.weight", c.head_dim)
            if c.attention_sinks:
                vector(a, "sinks", p + "self_attn.sinks", c.num_heads)
            if isinstance(layer.mlp, SparseMoE):
                self._load_experts(layer.mlp, p + "mlp.", refs, take, place, matrix, bias)
                continue
            matrix(layer.mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                   p + "gate_up_proj")
            matrix(layer.mlp.down_proj, [p + "mlp.down_proj.weight"], p + "down_proj")
            if c.mlp_bias:
                bias(layer.mlp.gate_up_proj, [p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"],
                     f"{p}mlp gate/up biases")
                bias(layer.mlp.down_proj, [p + "mlp.down_proj.bias"], f"{p}mlp.down_proj.bias")
        surplus = [k for k in refs if k not in used and not re.search(r"rotary_emb|inv_freq", k)]
        if surplus:
            raise ModelLoadError(f"weights have tensors the {c.model_type} model does not use: "
                                 f"{surplus[:5]}{' ...' if len(surplus) > 5 else ''}")

    def _load_experts(self, moe: SparseMoE, p: str, refs: dict, take, place, matrix,
                      bias) -> None:
        """The router and every expert of one layer. Experts stay views of the mapped file
        (copy=False): per-expert tensors (HF), or rows of the stacked [experts, rows, k]
        tensors a GGUF holds (`weight_names.expert_refs` slices them, no copy)."""
        from iterserve.model.weight_names import expert_refs
        c = self.config
        matrix(moe.router, [p + "router.weight"], p + "router")
        if c.router_bias:
            bias(moe.router, [p + "router.bias"], p + "router.bias")
        for e, expert in enumerate(moe.experts):
            parts = expert_refs(refs, p, e, c, take)
            q = f"{p}experts.{e}."
            try:
                expert.gate_up_proj.set_weight(place.matrix(parts["gate_up"], copy=False))
                expert.down_proj.set_weight(place.matrix(parts["down"], copy=False))
            except ValueError as err:
                raise ModelLoadError(f"{q}: {err}") from None
            expert.interleaved = parts["interleaved"]
            if c.expert_bias:
                for lin, key in ((expert.gate_up_proj, "gate_up_bias"),
                                 (expert.down_proj, "down_bias")):
                    b = torch.cat([place.vector(r).flatten() for r in parts[key]])
                    if b.shape != (lin.out_features,):
                        raise ModelLoadError(f"{q}{key} has {b.shape[0]} values, the config "
                                             f"implies {lin.out_features}")
                    lin.bias = nn.Parameter(b, requires_grad=False)

    def use_quant(self, on: bool = True) -> bool:
        """Turn the native GEMM over encoded blocks on (or off) for every Linear whose
        segment types have one; returns whether any uses it."""
        used = any([m.use_quant(on) for m in self.modules() if isinstance(m, Linear)])
        for m in self.modules():              # an expert block follows its Linears' paths
            if isinstance(m, SparseMoE) and m._route is not None:
                m.use_native(True)
        return used

    def use_native_ops(self, on: bool = True) -> bool:
        """RMSNorm, SiLU x up (gpt-oss's experts: their SwiGLU) and RoPE through the native elementwise kernels (kernels/elementwise.c),
        and expert layers through moe.c (`SparseMoE.use_native`), on CPU float32, or back to
        torch ops; returns whether they are in use."""
        native = on and self.norm.weight.device.type == "cpu" \
            and self.norm.weight.dtype == torch.float32 and kernels.available()
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m._native = kernels.rmsnorm if native else None
            elif isinstance(m, (MLP, Expert)):
                m._native = kernels.silu_mul if native else None
                if isinstance(m, Expert):
                    m._native_oai = kernels.swiglu_oai if native else None
            elif isinstance(m, Attention):
                m._rope = kernels.rope if native else None
                m._qk_norm = kernels.qk_norm if native else None
            elif isinstance(m, SparseMoE):
                m.use_native(native)
        return native

    def pack_linears(self, mode: str | bool | None = "onednn") -> bool:
        """Switch every Linear (the lm_head included) to prepacked weights ("onednn" or
        "mkl", see layers.Linear) or back to plain ones (None)."""
        return all([m.pack(mode) for m in self.modules() if isinstance(m, Linear)])


DecoderForCausalLM = LlamaForCausalLM


def _long_rope_rows(positions: torch.Tensor, meta: AttentionMetadata, rotary) -> torch.Tensor:
    """Which rows use LongRoPE's long factors: those of a sequence whose length after this
    step is past the pretraining length (HF decides per forward pass from the longest
    position, which for one sequence is this)."""
    ends = positions + 1
    row = meta.num_decodes
    for _, n, _ in meta.spans[meta.num_decodes:]:
        ends[row:row + n] = positions[row + n - 1] + 1
        row += n
    return ends > rotary.tables["global"].original_max_position
