"""What the decoder does not implement is refused at start, naming it and what is supported:
an unknown model_type or GGUF architecture, a rope type, an activation, or an option of a
supported family; `iterserve serve` exits 2 with the message instead of serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fixtures.tiny_models import make_tiny_model_dir
from iterserve.errors import GGUFLoadError, UnsupportedModelError
from iterserve.model.config import ModelConfig
from iterserve.model.gguf_loader import load_gguf

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=512, intermediate_size=128)


@pytest.mark.parametrize("model_type", ["falcon", "phimoe", "granitemoe", "deepseek_v3",
                                        "gemma3n", "qwen2_moe"])
def test_unknown_model_types_are_refused_with_the_supported_list(model_type):
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf({**BASE, "model_type": model_type})
    msg = str(e.value)
    assert repr(model_type) in msg
    for name in ("llama", "gemma3_text", "phi3", "smollm3", "granite", "qwen3_moe", "mixtral",
                 "gpt_oss"):
        assert name in msg


@pytest.mark.parametrize("hf, words", [
    ({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     ["'dynamic'", "longrope", "yarn"]),
    ({"model_type": "llama", "hidden_act": "relu"}, ["'relu'", "gelu_pytorch_tanh", "silu"]),
    ({"model_type": "gemma3_text", "head_dim": 16, "sliding_window": 6,
      "use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                              "long_factor": [1.0] * 8}}, ["longrope", "phi3"]),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}, ["shared expert"]),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0],
                                             "long_factor": [1.0]}}, ["short_factor", "8"]),
], ids=["rope-dynamic", "relu", "bidirectional", "longrope-llama", "shared-expert",
        "phi3-factors"])
def test_unsupported_options_are_refused(hf, words):
    with pytest.raises(Exception) as e:
        ModelConfig.from_hf({**BASE, **hf})
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value)


def test_unknown_gguf_architecture_lists_the_supported_ones(tmp_path):
    import gguf
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFLoadError) as e:
        load_gguf(path)
    msg = str(e.value)
    assert "'deepseek2'" in msg
    for name in ("gemma3", "phi3", "qwen3moe", "gpt-oss", "smollm3", "granite", "mixtral"):
        assert name in msg


def test_serve_exits_with_the_message_for_an_unsupported_model(tmp_path):
    d = make_tiny_model_dir(tmp_path, "llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "phimoe"
    (d / "config.json").write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "iterserve.cli", "serve", str(d), "--port", "18391"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 2, p.stderr[-2000:]
    assert "unsupported model_type 'phimoe'" in p.stderr and "gemma3_text" in p.stderr
