"""ModelConfig: the architecture facts the runner needs, read from an HF `config.json` dict.

Both loaders (HF directory, GGUF) produce an HF-style config dict, so there is one parser.
transformers 5 writes RoPE settings as `rope_parameters` (with `rope_theta` inside);
older files use `rope_theta` + `rope_scaling`: both spellings are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from iterserve.errors import ModelLoadError, UnsupportedModelError


LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = (*LLAMA_FAMILY, "gpt2")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# vLLM's spellings: "auto" keeps the checkpoint's dtype, "half" / "float" are aliases.
DTYPE_CHOICES = ("auto", "float32", "float", "bfloat16", "float16", "half")
_ALIASES = {"half": "float16", "float": "float32"}
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype for an explicit choice, None for "auto" (keep the checkpoint's)."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ModelLoadError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPE_CHOICES)}")
    dtype = _ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


def parse_kv_cache_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """`--kv-cache-dtype`: None for "auto" (the compute dtype, float32 on CPU)."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported kv_cache_dtype {dtype!r}; use one of "
                             f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
    return DTYPES[dtype]


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6                   # the LayerNorm eps for gpt2
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None   # rope_type != "default" parameters
    tie_word_embeddings: bool = False
    attention_bias: bool = False                 # bias on q/k/v (qwen2 always has it)
    qk_norm: bool = False                        # per-head RMSNorm on q and k (qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: torch.dtype = torch.float32           # compute dtype: activations, norms
    architectures: list[str] = field(default_factory=list)
    kv_cache_dtype: torch.dtype | None = None    # None: the compute dtype

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: torch.dtype = torch.float32) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r} (architectures "
                f"{hf.get('architectures')}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type == "gpt2":
            hf = _gpt2_as_llama_names(hf)
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            vocab = int(hf["vocab_size"])
            inter = int(hf["intermediate_size"])
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required key {e.args[0]!r}") from None
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")

        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}

        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        return cls(
            model_type=model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=int(window) if window else None,
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids, dtype=dtype,
            architectures=list(hf.get("architectures") or []),
            hidden_act=str(hf.get("activation_function", hf.get("hidden_act", "silu"))),
        )


def _gpt2_as_llama_names(hf: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 configs use their own key names (n_embd, n_head, ...); map them once here."""
    try:
        hidden = hf.get("n_embd", hf.get("hidden_size"))
        out = dict(hf, hidden_size=hidden, num_attention_heads=hf.get("n_head", hf.get("num_attention_heads")),
                   num_hidden_layers=hf.get("n_layer", hf.get("num_hidden_layers")),
                   intermediate_size=hf.get("n_inner") or 4 * int(hidden),
                   max_position_embeddings=hf.get("n_positions", hf.get("max_position_embeddings", 1024)),
                   rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                   tie_word_embeddings=hf.get("tie_word_embeddings", True))
    except TypeError:
        raise ModelLoadError("gpt2 config.json lacks n_embd") from None
    out.pop("num_key_value_heads", None)
    for unsupported in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(unsupported):
            raise UnsupportedModelError(f"gpt2 option {unsupported}=true is not supported")
    return out
