"""GPT-2: the second, different family (learned positions, LayerNorm with bias, full MHA,
GELU MLP, biased projections), over the same paged KV cache and attention as the Llama family.

HF stores GPT-2's projections as Conv1D ([in, out]); they are transposed once at load so
every projection is a plain Linear (and can take prepacked weights like the others).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.errors import ModelLoadError, UnsupportedModelError
from iterserve.model.attention import AttentionMetadata, paged_attention
from iterserve.model.config import ModelConfig
from iterserve.model.kv_cache import PagedKVCache
from iterserve.model.layers import LM_HEAD_AUTO_ACTIVATIONS, Linear

_ACTS = {"gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
         "gelu": F.gelu, "relu": F.relu, "silu": F.silu}


class GPT2Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.ln_1 = nn.LayerNorm(h, eps=c.rms_norm_eps)
        self.c_attn = Linear(h, 3 * h, bias=True)
        self.attn_proj = Linear(h, h, bias=True)
        self.ln_2 = nn.LayerNorm(h, eps=c.rms_norm_eps)
        self.c_fc = Linear(h, c.intermediate_size, bias=True)
        self.mlp_proj = Linear(c.intermediate_size, h, bias=True)
        if c.hidden_act not in _ACTS:
            raise UnsupportedModelError(f"gpt2 activation {c.hidden_act!r} is not supported")
        self.act = _ACTS[c.hidden_act]
        self.scale = c.head_dim ** -0.5

    def forward(self, x: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        T, H, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.c_attn(self.ln_1(x)).view(T, 3, H, d).unbind(1)
        x = x + self.attn_proj(paged_attention(q, k, v, k_slots, v_slots, meta, self.scale).reshape(T, H * d))
        return x + self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))


class GPT2ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size,
                              auto_activations=LM_HEAD_AUTO_ACTIVATIONS)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        if max_position >= self.config.max_position_embeddings:
            raise ValueError(f"position {max_position} is beyond gpt2's "
                             f"{self.config.max_position_embeddings} learned positions")
        x = self.wte(input_ids) + self.wpe(positions)
        for i, block in enumerate(self.h):
            x = block(x, kv_cache.k_slots[i], kv_cache.v_slots[i], meta)
        return self.ln_f(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        sd = {(k[len("transformer."):] if k.startswith("transformer.") else k): v for k, v in sd.items()}
        used: set[str] = set()

        def put(param: torch.Tensor, name: str, transpose: bool = False) -> None:
            if name not in sd:
                raise ModelLoadError(f"weights lack tensor {name!r}")
            used.add(name)
            value = sd[name].t() if transpose else sd[name]
            if tuple(param.shape) != tuple(value.shape):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(sd[name].shape)}, "
                                     f"the config implies {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(value.to(param.dtype))

        put(self.wte.weight, "wte.weight")
        put(self.wpe.weight, "wpe.weight")
        put(self.ln_f.weight, "ln_f.weight")
        put(self.ln_f.bias, "ln_f.bias")
        if self.config.tie_word_embeddings:
            used.add("lm_head.weight")
        else:
            put(self.lm_head.weight, "lm_head.weight")
        for i, b in enumerate(self.h):
            p = f"h.{i}."
            for mod, name, conv in ((b.ln_1, "ln_1", False), (b.ln_2, "ln_2", False),
                                    (b.c_attn, "attn.c_attn", True), (b.attn_proj, "attn.c_proj", True),
                                    (b.c_fc, "mlp.c_fc", True), (b.mlp_proj, "mlp.c_proj", True)):
                put(mod.weight, p + name + ".weight", transpose=conv)
                put(mod.bias, p + name + ".bias")
        surplus = [k for k in sd if k not in used and not k.endswith((".attn.bias", ".attn.masked_bias"))]
        if surplus:
            raise ModelLoadError(f"weights have tensors the gpt2 model does not use: {surplus[:5]}")

    def pack_linears(self, mode: str | bool | None = "onednn") -> bool:
        """Switch every Linear (the lm_head included) to prepacked weights ("onednn" or
        "mkl", see layers.Linear) or back to plain ones (None)."""
        return all([m.pack(mode) for m in self.modules() if isinstance(m, Linear)])
