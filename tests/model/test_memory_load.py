"""The load path stays cheap (issue 12: load time <= 1.5x llama-server's): what was cut must
stay cut.

- KV pools are kernel-supplied zero pages: allocating a big pool writes nothing (RSS does
  not grow), reads as zeros (the padded SDPA path relies on that), and grows as written.
- Fused q/k/v and gate/up reference the file's rows in place where they are in file order;
  only llama's Q/K rows (un-permuted) are copied.
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


def test_fused_parts_in_file_order_are_views_of_the_mapping(tmp_path):
    from iterserve.model.loader import load_model
    from iterserve.model.weights import EncodedWeight

    path = tmp_path / "m.gguf"
    write_tiny_llama_gguf(path, tensor_types={"attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0",
                                              "attn_v.weight": "Q8_0"})
    lm = load_model(str(path))
    layer, refs = lm.model.layers[0], lm.refs
    p = "model.layers.0."

    def in_mapping(w: torch.Tensor, name: str) -> bool:
        m = refs[name].mapping
        return m.data_ptr() <= w.data_ptr() < m.data_ptr() + m.numel()

    gu = layer.mlp.gate_up_proj.encoded
    assert len(gu.segments) == 2                                        # gate, up: no copy
    assert in_mapping(gu.segments[0][1], p + "mlp.gate_proj.weight")
    assert in_mapping(gu.segments[1][1], p + "mlp.up_proj.weight")
    qkv = layer.self_attn.qkv_proj.encoded
    (_, qk), (_, v) = qkv.segments                                      # q+k gathered, v in place
    assert not in_mapping(qk, p + "self_attn.q_proj.weight")
    assert in_mapping(v, p + "self_attn.v_proj.weight")
    for fused, names in ((gu, ["mlp.gate_proj", "mlp.up_proj"]),
                         (qkv, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])):
        expected = torch.cat([refs[p + n + ".weight"].to_float() for n in names])
        assert torch.equal(fused.dequantize(), expected)
    # more in-place parts than the kernels' 3 segments: same-type neighbours are copied
    parts = [refs[p + "mlp.gate_proj.weight"]] * 4
    four = EncodedWeight.fuse(parts)
    assert len(four.segments) == 1 and four.rows == 4 * parts[0].rows
    assert torch.equal(four.dequantize(), torch.cat([r.to_float() for r in parts]))


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
