"""Load a GGUF file as (HF-style config dict, HF-named state dict, Tokenizer).

GGUF is llama.cpp's single-file format: metadata keys under llama.cpp's names, tensors under
llama.cpp's names, many of them block-quantised. The rest of iterserve speaks HF
`transformers` (config.json keys, `model.layers.{i}.self_attn.q_proj.weight`), so this module
translates at the border (the file's header parsed by model/gguf.py) and the model code has
one format to know:

- metadata -> config.json keys (what `transformers` builds from the same file);
- tensors are not read at all here: each is a `weights.TensorRef` into the file's mapping,
  in its own encoding (model/weights.py says how they are fused and computed);
- llama's Q/K rows un-permuted: llama.cpp's converter reorders them for its interleaved
  ("normal") RoPE, transformers' loader reverses that, and we match transformers. A GGUF row
  is whole blocks, so the un-permutation is a row gather on the encoded rows.
"""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import torch

from iterserve.errors import GGUFLoadError
from iterserve.model.gguf import open_gguf
from iterserve.model.startup import phase
from iterserve.model.tokenizer import Tokenizer
from iterserve.model.weights import SUPPORTED_TYPES, TensorRef, type_name

__all__ = ["load_gguf", "read_gguf_config", "dequantize_state"]

log = logging.getLogger(__name__)


# llama.cpp architecture name -> (HF model_type, HF architectures entry). A llama GGUF with
# experts (expert_count) is Mixtral's.
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "granite": ("granite", "GraniteForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
}

# llama.cpp stores the Llama-derived converters' Q/K permuted for its rope (LlamaModel's
# permute: llama, mistral, Mixtral, Granite, SmolLM3); the others use NEOX rope as is.
_PERMUTED_QK = {"llama", "mistral", "granite", "smollm3"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Gemma's norms on the attention / MLP outputs (HF names; gpt-oss's post_attention_norm
    # is its pre-MLP norm, which HF also calls post_attention_layernorm)
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",                # phi3
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",                        # gpt-oss
    # Mixture of Experts: the router, and every expert stacked [experts, rows, k]
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_exps.bias": "mlp.experts.gate_proj.bias",
    "ffn_up_exps.bias": "mlp.experts.up_proj.bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj.bias",
}
# Per-architecture differences in the HF names of the same GGUF tensor
_ARCH_LAYER_TENSORS = {
    "gemma2": {"ffn_norm.weight": "pre_feedforward_layernorm.weight"},
    "gemma3": {"ffn_norm.weight": "pre_feedforward_layernorm.weight"},
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},          # gate and up, 2I rows
}
_LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors llama.cpp may write that carry nothing the HF model has (precomputed rope factors;
# Phi-3's LongRoPE factors are read into the config instead).
_IGNORED_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def _value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf_config(reader) -> dict:
    """The config.json-style dict for a GGUF's metadata (what transformers derives)."""
    arch = _value(reader, "general.architecture")
    name = (_value(reader, "general.name") or "").lower()
    prefix = arch                                      # metadata keys keep the file's name
    if arch == "llama" and (_value(reader, "llama.expert_count") or 0) > 0:
        arch = "mixtral"   # a llama GGUF with experts (Mixtral and its kin)
    elif arch == "llama" and "mistral" in name:
        arch = "mistral"   # llama.cpp writes Mistral as llama; transformers tells them apart so
    if arch not in _ARCHITECTURES and arch != "mixtral":
        raise GGUFLoadError(f"GGUF architecture {arch!r} is not supported "
                            f"(supported: {', '.join(sorted([*_ARCHITECTURES, 'llama with experts (mixtral)']))})")

    def key(k, default=None):
        return _value(reader, f"{prefix}.{k}", default)

    required = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size",
                "attention.head_count": "num_attention_heads"}
    missing = [k for k in required if key(k) is None]
    if missing:
        raise GGUFLoadError(f"GGUF metadata lacks {', '.join(f'{prefix}.{k}' for k in missing)}")
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = _value(reader, "tokenizer.ggml.tokens")
    vocab = key("vocab_size")
    if vocab is None:
        vocab = len(tokens) if tokens is not None else None
    if vocab is None:
        emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        vocab = int(emb.shape[-1]) if emb is not None else None
    model_type, hf_arch = _ARCHITECTURES.get(arch, ("mixtral", "MixtralForCausalLM"))
    config = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length") or key("rope.dimension_count")
                        or hidden // heads),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "vocab_size": int(vocab) if vocab is not None else None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _value(reader, "tokenizer.ggml.eos_token_id"),
    }
    if model_type == "qwen2":
        config["attention_bias"] = True
    scaling_type = key("rope.scaling.type")
    if scaling_type and scaling_type != "none" and model_type != "phi3":
        rope_scaling = {"rope_type": scaling_type, "type": scaling_type,
                        "factor": float(key("rope.scaling.factor", 1.0))}
        orig = key("rope.scaling.original_context_length")
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
        for k, hf_k in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_ext_factor", None), ("yarn_attn_factor", "attention_factor")):
            if key(f"rope.scaling.{k}") is not None and hf_k is not None:
                rope_scaling[hf_k] = float(key(f"rope.scaling.{k}"))
        config["rope_scaling"] = rope_scaling
    elif "rope_freqs.weight" in tensor_names:
        log.warning("GGUF has rope_freqs (Llama 3.1-style rope scaling) whose parameters the "
                    "metadata does not state; loading without rope scaling")
    _FAMILY_KEYS.get(model_type, lambda *a: None)(config, key, reader, tensor_names)
    return config


def _tensor_values(reader, name: str) -> list[float] | None:
    """A small F32 tensor's values (Phi-3's LongRoPE factors), or None."""
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        return None
    start, n = int(t.data_offset), int(t.n_bytes)
    return np.frombuffer(reader.data[start:start + n].tobytes(), dtype=np.float32).tolist()


def _gemma_keys(config: dict, key, reader, names, gemma3: bool) -> None:
    """llama.cpp's Gemma rules where the file states nothing: norms stored with their +1
    (the converter adds it), the sliding pattern (every 2nd / 6th layer global), the query
    scale (1/sqrt(head_dim) but 1/sqrt(hidden/heads) for the 27B shapes), the local RoPE base."""
    config["norm_weight_offset"] = 0.0
    config["tie_word_embeddings"] = "output.weight" not in names
    window = key("attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern is not None:
        config["sliding_window_pattern"] = int(pattern)
    big = config["num_hidden_layers"] == (62 if gemma3 else 46)
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                       if big else config["head_dim"])
    for k in ("attn_logit_softcapping", "final_logit_softcapping"):
        if key(k) is not None:
            config[k] = float(key(k))
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config["hidden_act"] = "gelu_pytorch_tanh"
    if gemma3:
        full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
        scaling = config.pop("rope_scaling", None)
        if scaling:
            full.update({k: v for k, v in scaling.items() if k != "type"})
        config["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(key("rope.freq_base_swa", 10000.0))}}


def _phi3_keys(config: dict, key, reader, names) -> None:
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    rot = key("rope.dimension_count")
    if rot:
        config["partial_rotary_factor"] = int(rot) / config["head_dim"]
    window = key("attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    short, long = (_tensor_values(reader, f"rope_factors_{n}.weight") for n in ("short", "long"))
    if short is not None and long is not None:
        scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                   "original_max_position_embeddings": int(
                       key("rope.scaling.original_context_length")
                       or config["max_position_embeddings"])}
        if key("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(key("rope.scaling.attn_factor"))
        config["rope_scaling"] = scaling


def _granite_keys(config: dict, key, reader, names) -> None:
    for gguf_key, hf_key in (("attention.scale", "attention_multiplier"),
                             ("embedding_scale", "embedding_multiplier"),
                             ("residual_scale", "residual_multiplier"),
                             ("logit_scale", "logits_scaling")):
        if key(gguf_key) is not None:
            config[hf_key] = float(key(gguf_key))


def _experts_keys(config: dict, key, reader, names) -> None:
    config["num_local_experts"] = config["num_experts"] = int(key("expert_count") or 0)
    config["num_experts_per_tok"] = int(key("expert_used_count") or 0)
    ffn = key("expert_feed_forward_length")
    if ffn is not None:
        config["moe_intermediate_size"] = int(ffn)
    if config["model_type"] == "gpt_oss":
        config["intermediate_size"] = int(ffn or config["intermediate_size"])
        window = key("attention.sliding_window")
        config["sliding_window"] = int(window) if window else None
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if config["model_type"] == "qwen3_moe":
        config["norm_topk_prob"] = True          # llama.cpp always renormalises Qwen3-MoE's


_FAMILY_KEYS = {
    "gemma2": lambda c, k, r, n: _gemma_keys(c, k, r, n, gemma3=False),
    "gemma3_text": lambda c, k, r, n: _gemma_keys(c, k, r, n, gemma3=True),
    "phi3": _phi3_keys,
    "granite": _granite_keys,
    # llama.cpp's SmolLM3 takes every 4th layer as NoPE (the file does not say)
    "smollm3": lambda c, k, r, n: c.update(no_rope_layer_interval=4),
    "qwen3_moe": _experts_keys, "mixtral": _experts_keys, "gpt_oss": _experts_keys,
}


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` (convert_hf_to_gguf.py), as transformers does it."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_NAME.match(gguf_name)
    if m:
        own = _ARCH_LAYER_TENSORS.get(arch, {}).get(m.group(2))
        hf = own or _LAYER_TENSORS.get(m.group(2))
        if hf is not None:
            return f"model.layers.{m.group(1)}.{hf}"
    return None


def _ref(path: str, reader, tensor) -> TensorRef:
    qtype = tensor.tensor_type
    if int(qtype) not in SUPPORTED_TYPES:
        names = sorted(type_name(t) for t in SUPPORTED_TYPES)
        raise GGUFLoadError(f"tensor {tensor.name!r} has quantisation type {qtype.name}, which "
                            f"is not supported (supported: {', '.join(names)})")
    # The reader gives GGUF's dims reversed (numpy order): [out, in] like HF's Linear weights.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    start, n = int(tensor.data_offset), int(tensor.n_bytes)
    if start + n > reader.data.shape[0]:
        raise GGUFLoadError(f"{path}: tensor {tensor.name!r} ends past the end of the file "
                            f"(truncated download?)")
    mapping = torch.from_numpy(reader.data[start:start + n])
    return TensorRef(tensor.name, int(qtype), shape, path, start, n, mapping,
                     file_map=reader.data)


def load_gguf(path, tokenizer: bool = True) -> tuple[dict, dict[str, TensorRef], Tokenizer | None]:
    """(config dict, HF-named tensor references, tokenizer) of a GGUF file.

    Nothing is decoded: every tensor stays a `TensorRef` into the file's mapping. llama's Q/K
    references carry the row permutation that undoes llama.cpp's (applied by whoever reads
    them, on whole rows of blocks). `tokenizer=False` (a `--tokenizer` replaces the file's
    own) skips building the file's tokenizer: None in its place."""
    path = os.fspath(path)
    with phase("metadata"):
        reader = open_gguf(path)
        config = read_gguf_config(reader)
    arch = _value(reader, "general.architecture")
    permuted = arch in _PERMUTED_QK
    refs: dict[str, TensorRef] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, arch)
        if name is None:
            if tensor.name in _IGNORED_TENSORS:
                continue
            raise GGUFLoadError(f"{path}: tensor {tensor.name!r} has no counterpart "
                                f"in a {config['model_type']} model")
        ref = _ref(path, reader, tensor)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if name.endswith("q_proj.weight")
                           else "num_key_value_heads"]
            if ref.rows % (2 * heads):
                raise GGUFLoadError(f"{name} has {ref.rows} rows, not a multiple of 2 x {heads} "
                                    f"heads")
            ref = ref.with_row_perm(_unpermute_qk(np.arange(ref.rows), heads))
        refs[name] = ref
    own = None
    if tokenizer:     # (read_gguf_config already took the vocabulary size from its tokens)
        with phase("tokenizer"):
            own = Tokenizer.from_gguf_metadata(reader)
    _check_shapes(config, {n: r.shape for n, r in refs.items()})
    config["torch_dtype"] = "float32"   # activations; the weights keep their own encodings
    return config, refs, own


def dequantize_state(refs: dict[str, TensorRef]) -> dict[str, torch.Tensor]:
    """Every tensor as float32 in HF layout (Q/K un-permuted): the reference tests compare
    against transformers' own GGUF loader. Never used to serve."""
    return {name: ref.to_float() for name, ref in refs.items()}


def _check_shapes(config: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """Fail at load, naming the tensor, rather than deep inside the first forward pass."""
    h, d = config["hidden_size"], config["head_dim"]
    q, kv, ffn = config["num_attention_heads"] * d, config["num_key_value_heads"] * d, \
        config["intermediate_size"]
    expected = {"model.embed_tokens.weight": (config["vocab_size"], h),
                "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (config["vocab_size"], h)
    # The other families' layer tensors differ (fused qkv, experts, extra norms): the
    # decoder's load_weights names any missing one and checks every shape.
    layers = config["num_hidden_layers"] if config["model_type"] in _LLAMA_FAMILY else 0
    for i in range(layers):
        p = f"model.layers.{i}."
        expected.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn)})
    for name, shape in expected.items():
        if name not in shapes:
            raise GGUFLoadError(f"GGUF lacks the tensor for {name}")
        if shape[0] is not None and tuple(shapes[name]) != shape:
            raise GGUFLoadError(f"{name} has shape {tuple(shapes[name])}, "
                                f"the config implies {shape}")
