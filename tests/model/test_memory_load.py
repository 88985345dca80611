"""The load path stays cheap (load time within 1.5x llama-server's): what was cut must stay
cut.

- KV pools are kernel-supplied zero pages: allocating a big pool writes nothing (RSS does
  not grow), reads as zeros (the padded SDPA path relies on that), and grows as written.
- Fused q/k/v and gate/up that are one range of the file are one view of the mapping; the
  rest is one buffer per run of one type, read with one file read per tensor.
- Serving a GGUF on CPU imports none of the heavy optional libraries.
- Every load phase logs its time (benchmarks/memory.py reads the lines).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fixtures.tiny_gguf import write_tiny_llama_gguf
from iterserve.model.config import ModelConfig
from iterserve.model.kv_cache import PagedKVCache, lazy_zeros

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))
MB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


def _config(layers=4, kv_heads=8, head_dim=64) -> ModelConfig:
    return ModelConfig.from_hf({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": layers, "num_attention_heads": 8,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": 1000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5})


def test_kv_pools_are_not_written_at_start_and_read_as_zeros():
    cfg = _config()
    num_blocks = 2048                                  # 4 layers x 2 x 2048 x 16 x 512 x 4 B
    before = _rss()
    cache = PagedKVCache(cfg, num_blocks=num_blocks, block_size=16, num_swap_blocks=512)
    total = sum(t.numel() * t.element_size() for t in
                (*cache.k, *cache.v, *cache.swap_k, *cache.swap_v))
    assert total >= 512 * MB
    grown = _rss() - before
    assert grown < 16 * MB, f"allocating {total / MB:.0f} MB of KV made RSS grow {grown / MB:.0f} MB"
    # reads are zeros (what torch.zeros gave), also through the flat slot views
    assert not cache.k[3].view(-1)[::4099].any() and not cache.v_slots[0][-1].any()
    # writes land and stay; only touched pages become resident
    rows = torch.arange(0, 200 * 16, 16)
    cache.k_slots[1].index_copy_(0, rows, torch.full((len(rows), 512), 1.5))
    assert float(cache.k_slots[1][rows].sum()) == 1.5 * 512 * len(rows)
    assert float(cache.k_slots[1].sum()) == 1.5 * 512 * len(rows)   # nothing else changed
    cache.swap_out([(16, 7)])
    assert torch.equal(cache.swap_k[1][7], cache.k[1][16])
    cache.swap_in([(7, 2000)])
    assert torch.equal(cache.k[1][2000], cache.k[1][16]) and cache.k[1][2000].any()
    assert _rss() - before < 64 * MB


def test_lazy_zeros_is_zeros_and_keeps_its_mapping_alive():
    t = lazy_zeros((64, 1024, 32), torch.float16)          # 4 MiB: a mapping
    small = lazy_zeros((3, 5), torch.bfloat16)            # below the threshold: torch.zeros
    assert t.shape == (64, 1024, 32) and t.dtype == torch.float16 and t.is_contiguous()
    assert small.dtype == torch.bfloat16 and not small.any()
    views = list(t.unbind(0))
    del t
    import gc
    gc.collect()
    views[63][-1, -1] = 2.0                               # the mapping outlived `t`
    assert float(views[63].sum()) == 2.0 and not views[0].any()


def _write_safetensors(path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file with the tensors in exactly this order (save_file sorts them)."""
    import json
    import struct
    header, blobs, off = {}, [], 0
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    for name, t in tensors:
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def test_fused_neighbours_are_one_view_of_the_mapping_and_the_rest_one_copy(tmp_path):
    """q/k/v, gate/up: parts that are one range of the file (HF checkpoints store them in
    order) are one zero-copy segment; parts apart, or whose rows are gathered, are read into
    one buffer; one segment per run of one type, never more (each is a GEMM call per step)."""
    from iterserve.model.hf_loader import read_safetensors
    from iterserve.model.loader import load_model
    from iterserve.model.weights import EncodedWeight

    g = torch.Generator().manual_seed(0)
    t = {n: torch.randn(r, 32, generator=g) for n, r in (("a", 4), ("b", 6), ("c", 2),
                                                          ("gap", 1), ("d", 3))}
    t["h"] = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    path = tmp_path / "x.safetensors"
    _write_safetensors(path, [(n, t[n]) for n in ("a", "b", "c", "gap", "d", "h")])
    refs = read_safetensors(path)
    base = refs["a"].file_map.ctypes.data

    def in_mapping(w):
        return base <= w.data_ptr() < base + refs["a"].file_map.size

    def check(names, n_segments, mapped):
        fused = EncodedWeight.fuse([refs[n] for n in names])
        assert len(fused.segments) == n_segments, names
        assert [in_mapping(w) for _, w in fused.segments] == mapped, names
        assert torch.equal(fused.dequantize(), torch.cat([t[n].float() for n in names]))

    check(["a", "b", "c"], 1, [True])                  # neighbours: one view, no copy
    check(["a"], 1, [True])
    check(["a", "d"], 1, [False])                      # apart: one buffer
    check(["b", "a"], 1, [False])                      # out of file order: one buffer
    check(["c", "gap", "d", "h"], 2, [True, True])     # F32 run, then the BF16 tensor

    # a GGUF: llama's Q/K rows are gathered (one buffer with v when v has their type)
    gguf_path = tmp_path / "m.gguf"
    write_tiny_llama_gguf(gguf_path, tensor_types={
        "attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0", "attn_v.weight": "Q4_0"})
    lm = load_model(str(gguf_path))
    p = "model.layers.0."
    qkv = lm.model.layers[0].self_attn.qkv_proj.encoded
    (_, qk), (_, v) = qkv.segments
    mapping = lm.refs[p + "self_attn.v_proj.weight"].file_map
    lo, hi = mapping.ctypes.data, mapping.ctypes.data + mapping.size
    assert not lo <= qk.data_ptr() < hi and lo <= v.data_ptr() < hi
    expected = torch.cat([lm.refs[p + f"self_attn.{n}_proj.weight"].to_float() for n in "qkv"])
    assert torch.equal(qkv.dequantize(), expected)


def test_every_load_phase_logs_its_time(tmp_path, caplog):
    from iterserve.engine.args import EngineArgs
    from iterserve.engine.builder import build_engine_parts

    path = tmp_path / "m.gguf"
    write_tiny_llama_gguf(path)
    with caplog.at_level(logging.INFO, logger="iterserve.startup"):
        build_engine_parts(EngineArgs(model=str(path), num_kv_blocks=64, max_model_len=256))
    sys.path.insert(0, os.path.join(SRC, "..", "benchmarks"))
    try:
        from memory import load_phases
    finally:
        sys.path.pop(0)
    phases = load_phases(caplog.text)
    assert {"metadata", "tokenizer", "weights", "kv_alloc", "runner"} <= set(phases), caplog.text
    assert all(v >= 0 for v in phases.values())


# Heavy optional libraries that serving a GGUF on CPU must not import (they cost seconds of
# start-up, or are not installed at all without their extras).
HEAVY = ("transformers", "ray", "xgrammar", "llguidance", "playwright", "vllm", "safetensors",
         "jinja2", "torch._dynamo", "sklearn", "scipy", "pandas")

_BUILD_APP = textwrap.dedent("""
    import sys
    from iterserve.cli import build_parser
    from iterserve.server.cli import build_app
    args = build_parser("serve").parse_args(["serve", "--model", sys.argv[1]])
    app, engine = build_app(args)
    print(" ".join(m for m in sys.argv[2:] if m in sys.modules))
""")


def test_serving_a_gguf_imports_no_heavy_optional_library(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama_gguf(path)
    proc = subprocess.run([sys.executable, "-c", _BUILD_APP, str(path), *HEAVY],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [], f"imported at serve start: {proc.stdout.strip()}"
