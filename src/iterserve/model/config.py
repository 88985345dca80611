"""ModelConfig: the architecture facts the runner needs, read from an HF `config.json` dict.

Both loaders (HF directory, GGUF) produce an HF-style config dict, so there is one parser.
transformers 5 writes RoPE settings as `rope_parameters` (with `rope_theta` inside, and for
Gemma 3 one entry per layer type); older files use `rope_theta` + `rope_scaling`: both
spellings are accepted.

Every decoder family iterserve runs is one decoder (model/llama.py) whose variations are
fields here, set per family by `_FAMILIES` (as vLLM and HF describe their families by config):
per-layer attention types (sliding / full, a window each), layers without RoPE, partial
rotary, per-layer-type RoPE bases, q/k norms, biases, the Gemma norms and multipliers,
soft-capping, attention sinks, and Mixture-of-Experts layers with their routing. A
model_type, rope type or option the decoder does not implement is refused here, at start,
with a message that names it and lists what is supported: never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from iterserve.errors import ModelLoadError, UnsupportedModelError


LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
# Dense families on the one decoder, then Mixture-of-Experts ones; gpt2 has its own module.
DENSE_FAMILIES = (*LLAMA_FAMILY, "granite", "smollm3", "phi3", "gemma2", "gemma3_text", "gemma3")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
DECODER_FAMILIES = (*DENSE_FAMILIES, *MOE_FAMILIES)
SUPPORTED_MODEL_TYPES = (*DECODER_FAMILIES, "gpt2")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# vLLM's spellings: "auto" keeps the checkpoint's dtype, "half" / "float" are aliases.
DTYPE_CHOICES = ("auto", "float32", "float", "bfloat16", "float16", "half")
_ALIASES = {"half": "float16", "float": "float32"}
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")

FULL, SLIDING = "full_attention", "sliding_attention"


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
    qk_norm: bool = False                        # per-head RMSNorm on q and k (qwen3, gemma3)
    sliding_window: int | None = None            # one window for every layer (mistral, phi3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: torch.dtype = torch.float32           # compute dtype: activations, norms
    architectures: list[str] = field(default_factory=list)
    kv_cache_dtype: torch.dtype | None = None    # None: the compute dtype
    # --- per-layer attention -------------------------------------------------------------
    # FULL or SLIDING per layer; a SLIDING layer attends to its last `layer_window` tokens.
    layer_types: list[str] = field(default_factory=list)
    layer_window: int | None = None              # the SLIDING layers' window (gemma, gpt-oss)
    rope_layers: list[bool] = field(default_factory=list)   # False: a NoPE layer (smollm3)
    partial_rotary_factor: float = 1.0           # phi3: RoPE on the first part of each head
    # RoPE of the SLIDING layers when it differs from the full layers' (gemma3's local base)
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    attention_scale: float | None = None         # None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # gemma2
    attention_sinks: bool = False                # gpt-oss: one learned sink logit per head
    o_bias: bool = False                         # bias on o_proj (granite, gpt-oss, llama's option)
    mlp_bias: bool = False
    # --- residual stream -----------------------------------------------------------------
    norm_weight_offset: float = 0.0              # gemma: norms scale by (offset + weight)
    sandwich_norms: bool = False                 # gemma: norms after attention and after the MLP
    embedding_multiplier: float = 1.0            # gemma: sqrt(hidden); granite: its multiplier
    residual_multiplier: float = 1.0             # granite
    logits_scaling: float = 1.0                  # granite: logits divided by it
    final_logit_softcapping: float | None = None  # gemma2
    # --- Mixture of Experts ----------------------------------------------------------------
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: list[bool] = field(default_factory=list)
    # "softmax_topk" (softmax over all experts, top-k, renormalised when norm_topk_prob:
    # qwen3_moe, mixtral) or "topk_softmax" (top-k logits, softmax over them: gpt-oss)
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    # "silu" (SwiGLU) or "swiglu_oai" (gpt-oss: clamped, alpha-scaled, (up + 1))
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within (None: the whole context)."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.layer_window
        return self.sliding_window

    def layer_windows(self) -> list[int | None]:
        return [self.window_of(i) for i in range(self.num_layers)]

    def uses_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def native_moe(self) -> bool:
        """Whether the expert layers are what moe.c runs: its two routings (softmax top-k,
        top-k softmax) and its two expert activations (SwiGLU, gpt-oss's clamped SwiGLU),
        biases or none: every MoE family here (Qwen3-MoE, Mixtral, gpt-oss)."""
        return (self.router in ("softmax_topk", "topk_softmax")
                and self.expert_act in ("silu", "swiglu_oai"))

    @property
    def llama_like(self) -> bool:
        """Whether every layer is a plain pre-norm Llama layer (what kernels.DecodeLayers
        runs), its MLP possibly experts that moe.c runs (`native_moe`): no extra norms,
        multipliers, soft-caps, sinks, biases beyond q/k/v, NoPE or partial RoPE, other expert
        layers, per-layer windows or GeGLU."""
        return ((not any(self.moe_layers) or self.native_moe) and not self.layer_types
                and all(self.rope_layers or [True]) and self.partial_rotary_factor == 1.0 and self.attn_logit_softcapping is None
                and not self.attention_sinks and not self.o_bias and not self.mlp_bias
                and not self.sandwich_norms and self.residual_multiplier == 1.0
                and self.hidden_act == "silu" and not _is_longrope(self.rope_scaling))

    @property
    def decode_layers_fit(self) -> bool:
        """Whether kernels.DecodeLayers runs every layer: `llama_like`, or gpt-oss's layers
        (per-layer sliding / full windows, attention sinks, an o bias, its expert block),
        everything else about them plain."""
        if self.llama_like:
            return True
        plain = replace(self, layer_types=[], attention_sinks=False, o_bias=False)
        return self.attention_sinks and set(self.layer_types) <= {FULL, SLIDING} \
            and plain.llama_like

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: torch.dtype = torch.float32) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r} (architectures "
                f"{hf.get('architectures')}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type == "gpt2":
            hf = _gpt2_as_llama_names(hf)
        if model_type == "gemma3":             # the multimodal checkpoint: its text model
            hf = gemma3_text_config(hf)
            model_type = "gemma3_text"
        quant = (hf.get("quantization_config") or {}).get("quant_method")
        if quant is not None and not (quant == "mxfp4" and model_type == "gpt_oss"):
            raise UnsupportedModelError(
                f"{model_type}: checkpoints quantised with {quant!r} are not supported (use the "
                "bf16 / fp16 checkpoint or a GGUF file; gpt-oss's own MXFP4 experts are read)")
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            vocab = int(hf["vocab_size"])
            inter = int(hf.get("intermediate_size") or 0)
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required key {e.args[0]!r}") from None
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")

        rope_all = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        per_type = FULL in rope_all or SLIDING in rope_all      # gemma3's per-layer-type form
        rope = dict(rope_all.get(FULL) or {}) if per_type else rope_all
        theta, scaling = _rope(rope, hf.get("rope_theta", 10000.0), model_type)

        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        act = str(hf.get("activation_function") or hf.get("hidden_activation")
                  or hf.get("hidden_act") or "silu")
        c = cls(
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
            hidden_act=act,
        )
        if model_type == "gpt2":
            return c
        family = _FAMILIES.get(model_type)
        if family is not None:
            family(c, hf, rope_all if per_type else None)
        _check(c)
        return c


def gemma3_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal Gemma 3 checkpoint (its `text_config`, with
    the top level's token ids where the text config lacks them)."""
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ModelLoadError("a gemma3 config.json without text_config")
    for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings", "vocab_size"):
        if k not in text and k in hf:
            text[k] = hf[k]
    text.setdefault("vocab_size", 262208)
    text["model_type"] = "gemma3_text"
    text.setdefault("architectures", hf.get("architectures"))
    return text


def _is_longrope(scaling: dict | None) -> bool:
    return bool(scaling) and scaling.get("rope_type") == "longrope"


def _rope(rope: dict, default_theta, model_type: str) -> tuple[float, dict | None]:
    """(theta, scaling or None) of one RoPE parameter dict, refusing unknown rope types."""
    rope = dict(rope)
    theta = float(rope.pop("rope_theta", default_theta))
    rope.pop("partial_rotary_factor", None)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"               # Phi-3's legacy names for LongRoPE (as HF maps)
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{model_type}: rope_type {rope_type!r} is not supported (supported: "
            f"{', '.join(ROPE_TYPES)})")
    return theta, (None if rope_type == "default" else {**rope, "rope_type": rope_type})


def _layer_types(hf: dict, n: int, pattern_default: int | None, window) -> list[str]:
    """The config's layer_types, else the sliding pattern's (every `pattern`-th layer full)."""
    types = hf.get("layer_types")
    if types:
        types = list(types)
        if len(types) != n or any(t not in (FULL, SLIDING) for t in types):
            raise UnsupportedModelError(
                f"layer_types {types} is not {n} of {FULL!r} / {SLIDING!r}")
        return types
    pattern = hf.get("sliding_window_pattern", pattern_default)
    if not window or not pattern:
        return [FULL] * n
    return [SLIDING if (i + 1) % int(pattern) else FULL for i in range(n)]


def _gemma(c: ModelConfig, hf: dict, rope_per_type: dict | None, *, gemma3: bool) -> None:
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{c.model_type}: use_bidirectional_attention=true (an "
                                    "encoder) is not supported")
    window = hf.get("sliding_window")
    c.layer_types = _layer_types(hf, c.num_layers, 6 if gemma3 else 2, window)
    c.layer_window = int(window) if window else None
    c.sliding_window = None
    c.attention_scale = float(hf.get("query_pre_attn_scalar") or c.head_dim) ** -0.5
    # HF stores Gemma's norm weights as w (applied as 1 + w); llama.cpp's converter stores
    # 1 + w, and the GGUF loader says so with norm_weight_offset 0
    c.norm_weight_offset = float(hf.get("norm_weight_offset", 1.0))
    c.sandwich_norms = True
    c.embedding_multiplier = c.hidden_size ** 0.5
    c.tie_word_embeddings = bool(hf.get("tie_word_embeddings", True))
    c.final_logit_softcapping = _opt_float(hf.get("final_logit_softcapping"))
    c.attn_logit_softcapping = _opt_float(hf.get("attn_logit_softcapping"))
    if gemma3:
        c.qk_norm = True
        local = dict((rope_per_type or {}).get(SLIDING) or {})
        c.local_rope_theta, c.local_rope_scaling = _rope(
            local, hf.get("rope_local_base_freq", 10000.0), c.model_type)
        if rope_per_type is None and "rope_theta" not in hf:
            c.rope_theta = 1_000_000.0       # Gemma 3's global base when the file omits it
    elif rope_per_type is not None:
        raise UnsupportedModelError("gemma2 with per-layer-type rope_parameters")


def _gpt_oss(c: ModelConfig, hf: dict, rope_per_type) -> None:
    window = hf.get("sliding_window")
    c.layer_types = _layer_types(hf, c.num_layers, 2, window)
    c.layer_window = int(window) if window else None
    c.sliding_window = None
    c.attention_sinks = True
    c.attention_bias = c.o_bias = bool(hf.get("attention_bias", True))
    _moe(c, hf, experts=int(hf.get("num_local_experts", 0)),
         inter=int(hf.get("intermediate_size", 0)), router="topk_softmax", norm=False)
    c.router_bias = c.expert_bias = True
    c.expert_act = "swiglu_oai"
    c.swiglu_alpha = float(hf.get("swiglu_alpha", 1.702))
    c.swiglu_limit = float(hf.get("swiglu_limit", 7.0))


def _moe(c: ModelConfig, hf: dict, *, experts: int, inter: int, router: str, norm: bool,
         dense: set[int] = frozenset(), step: int = 1) -> None:
    k = int(hf.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= k <= experts or inter < 1:
        raise ModelLoadError(f"{c.model_type}: {experts} experts, {k} per token, expert "
                             f"intermediate size {inter}: not a Mixture-of-Experts config")
    c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size = experts, k, inter
    c.router, c.norm_topk_prob = router, norm
    c.moe_layers = [i not in dense and (i + 1) % step == 0 for i in range(c.num_layers)]


def _qwen3_moe(c: ModelConfig, hf: dict, rope_per_type) -> None:
    c.qk_norm = True
    if hf.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("qwen3_moe with a shared expert is not supported")
    _moe(c, hf, experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
         inter=int(hf.get("moe_intermediate_size", 0)), router="softmax_topk",
         norm=bool(hf.get("norm_topk_prob", False)),
         dense=set(hf.get("mlp_only_layers") or ()), step=int(hf.get("decoder_sparse_step", 1)))


def _mixtral(c: ModelConfig, hf: dict, rope_per_type) -> None:
    _moe(c, hf, experts=int(hf.get("num_local_experts", 0)),
         inter=int(hf.get("intermediate_size", 0)), router="softmax_topk", norm=True)


def _llama(c: ModelConfig, hf: dict, rope_per_type) -> None:
    if c.model_type in ("llama", "granite", "smollm3") and c.attention_bias:
        c.o_bias = True                      # HF's attention_bias covers o_proj in these
    c.mlp_bias = bool(hf.get("mlp_bias", False))


def _granite(c: ModelConfig, hf: dict, rope_per_type) -> None:
    _llama(c, hf, rope_per_type)
    c.embedding_multiplier = float(hf.get("embedding_multiplier", 1.0))
    c.residual_multiplier = float(hf.get("residual_multiplier", 1.0))
    c.logits_scaling = float(hf.get("logits_scaling", 1.0))
    if hf.get("attention_multiplier") is not None:
        c.attention_scale = float(hf["attention_multiplier"])


def _smollm3(c: ModelConfig, hf: dict, rope_per_type) -> None:
    _llama(c, hf, rope_per_type)
    n = c.num_layers
    no_rope = hf.get("no_rope_layers")
    if no_rope is None:
        interval = int(hf.get("no_rope_layer_interval", 4))
        no_rope = [int((i + 1) % interval != 0) for i in range(n)]
    if len(no_rope) != n:
        raise ModelLoadError(f"smollm3: no_rope_layers has {len(no_rope)} entries for {n} layers")
    c.rope_layers = [bool(x) for x in no_rope]     # HF's name: 1 = this layer uses RoPE
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    c.sliding_window = None
    if window:
        c.layer_types = [SLIDING if not r else FULL for r in c.rope_layers] \
            if not hf.get("layer_types") else _layer_types(hf, n, None, window)
        c.layer_window = int(window)


def _phi3(c: ModelConfig, hf: dict, rope_per_type) -> None:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    c.partial_rotary_factor = float(rope.get("partial_rotary_factor")
                                    or hf.get("partial_rotary_factor") or 1.0)
    if _is_longrope(c.rope_scaling):
        s = dict(c.rope_scaling)
        half = c.rotary_dim // 2
        for k in ("short_factor", "long_factor"):
            if not isinstance(s.get(k), list) or len(s[k]) != half:
                raise ModelLoadError(f"phi3: longrope {k} must be a list of {half} numbers")
        s.setdefault("original_max_position_embeddings",
                     hf.get("original_max_position_embeddings") or c.max_position_embeddings)
        c.rope_scaling = s


def _opt_float(x) -> float | None:
    return None if x is None else float(x)


_FAMILIES = {
    "llama": _llama, "mistral": _llama, "granite": _granite, "smollm3": _smollm3,
    "phi3": _phi3,
    "gemma2": lambda c, hf, r: _gemma(c, hf, r, gemma3=False),
    "gemma3_text": lambda c, hf, r: _gemma(c, hf, r, gemma3=True),
    "qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "gpt_oss": _gpt_oss,
}


def _check(c: ModelConfig) -> None:
    """Options the decoder does not implement, refused with what is supported."""
    act = c.hidden_act
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{c.model_type}: hidden activation {act!r} is not "
                                    f"supported (supported: {', '.join(ACTIVATIONS)})")
    if c.rotary_dim % 2 or not 0 < c.rotary_dim <= c.head_dim:
        raise UnsupportedModelError(f"{c.model_type}: partial_rotary_factor "
                                    f"{c.partial_rotary_factor} of head_dim {c.head_dim}")
    if _is_longrope(c.rope_scaling) and c.model_type != "phi3":
        raise UnsupportedModelError(f"{c.model_type}: longrope is supported for phi3 only")
    if c.layer_types and SLIDING in c.layer_types and not c.layer_window:
        raise ModelLoadError(f"{c.model_type}: sliding layers without a sliding_window")
    if c.intermediate_size < 1 and not all(c.moe_layers or [False]):
        raise ModelLoadError(f"{c.model_type}: config.json lacks intermediate_size")


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
