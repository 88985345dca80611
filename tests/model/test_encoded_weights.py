"""Weights stay in their file's encoding (model/weights.py, layers.Linear / Embedding).

Per GGUF type, a Linear over real block layouts must equal gguf-py's dequantisation + a float
matmul at decode and prefill row counts, on the native kernel and on the reference tiles;
fused weights stack segments of different types; an embedding lookup decodes only its rows
and a tied LM head shares the table; nothing is copied that need not be.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, quants

from fixtures.tiny_gguf import random_blocks, write_tiny_llama_gguf
from iterserve.errors import ModelLoadError
from iterserve.model import weights as weights_mod
from iterserve.model.layers import Embedding, Linear
from iterserve.model.weights import EncodedWeight

QUANTISABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]          # gguf-py writes these
HAND_PACKED = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
FLOATS = ["F32", "F16", "BF16"]
K = 512                                                          # two K-quant super-blocks


def _encoded(kind: str, n: int, k: int = K, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [n, row_bytes] blocks of `kind`, their float32 [n, k] as gguf-py decodes them)."""
    rng = np.random.default_rng(seed)
    if kind in HAND_PACKED:
        raw = random_blocks(kind, n, k, rng)
    else:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = w if kind == "F32" else quants.quantize(w, Q[kind])
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
    if kind in FLOATS:      # gguf-py's float "dequantisers" want their own dtypes
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
        ref = torch.from_numpy(raw.copy()).view(dt).float().numpy()
    else:
        ref = quants.dequantize(raw, Q[kind]).reshape(n, k).astype(np.float32)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    return torch.from_numpy(np.ascontiguousarray(raw)).view(n, -1), torch.from_numpy(ref)


def _linear(segments, k=K, bias=False) -> Linear:
    lin = Linear(k, sum(w.shape[0] for _, w in segments), bias=bias)
    lin.set_weight(EncodedWeight(segments, k))
    return lin


@pytest.mark.parametrize("kind", FLOATS + QUANTISABLE + HAND_PACKED)
@pytest.mark.parametrize("native", [True, False])
def test_linear_equals_gguf_dequantise_then_matmul(kind, native):
    w, ref = _encoded(kind, 96)
    lin = _linear([(int(Q[kind]), w)])
    lin.use_quant(native)
    for rows in (1, 7, 32, 300):
        x = torch.randn(rows, K)
        expected = x.double() @ ref.double().t()
        # float32 summation order: the error is bounded relative to sum |x_i w_i|
        bound = 2e-5 * (x.double().abs() @ ref.double().abs().t()) + 1e-6
        err = (lin(x).double() - expected).abs()
        assert (err <= bound).all(), (kind, rows, native, float((err / bound).max()))


def test_reference_path_tiles_rows_into_a_bounded_scratch(monkeypatch):
    """A small tile budget forces many tiles per segment (and tiles that end mid-segment)."""
    monkeypatch.setattr(weights_mod, "TILE_BYTES", 16 * 4 * K)       # 16 rows per tile
    monkeypatch.setattr("iterserve.model.layers.tile_rows", weights_mod.tile_rows)
    (wa, ra), (wb, rb) = _encoded("Q6_K", 40, seed=1), _encoded("Q4_K", 24, seed=2)
    lin = _linear([(int(Q.Q6_K), wa), (int(Q.Q4_K), wb)], bias=True)
    torch.nn.init.normal_(lin.bias)
    lin.use_quant(False)
    seen = []
    real = weights_mod.decode_rows
    monkeypatch.setattr("iterserve.model.layers.decode_rows",
                        lambda t, w, k, out: (seen.append(w.shape[0]), real(t, w, k, out))[1])
    x = torch.randn(300, K)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, torch.cat([ra, rb]), lin.bias),
                               rtol=1e-4, atol=2e-3)      # weights up to ~40: fp32 order
    assert max(seen) <= 16 and sum(seen) == 64


def test_fused_weight_of_mixed_types_keeps_one_segment_per_type(tmp_path):
    """q/k Q4_K + v Q6_K (a Q4_K_M layout): two segments, rows in q, k, v order."""
    from iterserve.model.gguf_loader import load_gguf
    from iterserve.model.loader import load_model
    path = tmp_path / "mixed.gguf"
    info = write_tiny_llama_gguf(path, tensor_types={
        "attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0", "attn_v.weight": "Q4_0"})
    loaded = load_model(str(path))
    qkv = loaded.model.layers[0].self_attn.qkv_proj.encoded
    assert qkv.types == [Q.Q8_0, Q.Q4_0]
    assert [w.shape[0] for _, w in qkv.segments] == [64 + 32, 32]
    # q and k were read (and un-permuted) into one new buffer; v is the mapping itself
    _, refs, _ = load_gguf(path)
    v = refs["model.layers.0.self_attn.v_proj.weight"]
    assert qkv.segments[1][1].data_ptr() != v.mapping.data_ptr()   # another mapping of the file
    assert torch.equal(qkv.segments[1][1], v.view())
    expected = torch.cat([refs[f"model.layers.0.self_attn.{n}_proj.weight"].to_float()
                          for n in "qkv"])
    assert torch.equal(qkv.dequantize(), expected)
    q = torch.from_numpy(info["weights"]["model.layers.0.self_attn.q_proj.weight"])
    assert (qkv.dequantize()[:64] - q).abs().max() < 0.01 * q.abs().max() * 4   # un-permuted


def test_embedding_decodes_only_looked_up_rows_and_a_tied_head_shares_the_table(monkeypatch):
    w, ref = _encoded("Q8_0", 200, k=64)
    table = EncodedWeight([(int(Q.Q8_0), w)], 64)
    emb = Embedding(200, 64)
    emb.set_weight(table)
    decoded = []
    real = weights_mod.decode_rows
    monkeypatch.setattr(weights_mod, "decode_rows",
                        lambda t, w, k, out: (decoded.append(w.shape[0]), real(t, w, k, out))[1])
    ids = torch.tensor([[3, 199], [0, 3]])
    out = emb(ids)
    assert out.shape == (2, 2, 64) and decoded == [4]
    assert torch.equal(out, ref[ids])
    assert emb.weight is None and emb.encoded is table


def test_loaded_models_hold_no_float_copy_of_an_encoded_matrix(tmp_path):
    from iterserve.model.loader import load_model
    path = tmp_path / "tied.gguf"
    write_tiny_llama_gguf(path, tensor_types={"attn_q.weight": "Q4_1", "attn_k.weight": "Q4_1"})
    lm = load_model(str(path))
    m = lm.model
    floats = [n for n, p in m.named_parameters() if p.dim() == 2]
    assert floats == []                        # every matrix stays encoded (F16 / Q blocks)
    # the file's own F32 rows are used in place: the lm_head (F16 here) is one segment
    assert m.lm_head.encoded.types == [Q.F16]


def test_tied_lm_head_shares_the_embedding_blocks(tmp_path):
    from iterserve.model.loader import load_model
    from fixtures.tiny_gguf import write_random_llama_gguf
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, rms_norm_eps=1e-5, rope_theta=1e4,
               max_position_embeddings=128)
    write_random_llama_gguf(tmp_path / "t.gguf", cfg, "Q4_0")
    m = load_model(str(tmp_path / "t.gguf")).model
    assert m.config.tie_word_embeddings
    assert m.lm_head.encoded is m.embed_tokens.encoded


def test_hf_bf16_checkpoint_stays_bf16_and_matches_transformers(tmp_path):
    """An HF directory saved in bf16: weights stay bf16 segments (views of the mapping),
    activations float32; logits equal transformers' float32 model over the same bf16 weights."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from fixtures.tiny_models import make_tiny_model_dir
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner
    from fixtures.tiny_models import Blocks, chunk, greedy, request, step
    import transformers

    d = make_tiny_model_dir(tmp_path, "llama")
    st = load_file(str(d / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in st.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    lm = load_model(str(d))
    o = lm.model.layers[0].self_attn.o_proj
    assert o.weight is None and o.encoded.types == [Q.BF16]
    assert lm.config.dtype == torch.float32
    runner = ModelRunner(lm, num_blocks=8, block_size=4, sampler=greedy)
    prompt = [5, 6, 7, 8, 9]
    ours = runner.compute_logits(step(chunk(Blocks(8, 4), request("r", prompt))))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16).float()
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0, -1:]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_safetensors_tensors_are_views_of_the_mapping(tmp_path):
    from safetensors.torch import save_file
    from iterserve.model.hf_loader import read_safetensors
    t = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16),
         "c": torch.randn(2, 2).half()}
    save_file(t, str(tmp_path / "x.safetensors"))
    refs = read_safetensors(tmp_path / "x.safetensors")
    for name, v in t.items():
        assert torch.equal(refs[name].to_float(), v.float()), name
    assert refs["a"].view().data_ptr() == refs["a"].mapping.data_ptr()
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ModelLoadError, match="not a safetensors file"):
        read_safetensors(tmp_path / "bad.safetensors")


def test_kv_cache_dtype_float16_halves_the_pools_and_keeps_the_logits(tmp_path):
    from fixtures.tiny_models import Blocks, advance, chunk, greedy, request, step
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner

    path = tmp_path / "m.gguf"
    write_tiny_llama_gguf(path)
    results = {}
    for kv in ("auto", "float16", "bfloat16"):
        lm = load_model(str(path), kv_cache_dtype=kv)
        runner = ModelRunner(lm, num_blocks=16, block_size=4, sampler=greedy)
        assert runner.memory_plan["kv_cache"]["dtype"] == ("float32" if kv == "auto" else kv)
        blocks, r = Blocks(16, 4), request("r", list(range(5, 20)))
        seen = []
        for s in range(4):
            out = step(chunk(blocks, r), step_no=s)
            seen.append(runner.compute_logits(out))
            advance(out, runner.execute(out))
        results[kv] = (runner.kv_cache.k[0].element_size(), seen,
                       ModelRunner.kv_cache_bytes_per_block(lm.config, 4))
    assert results["float16"][0] == 2 and results["auto"][0] == 4
    assert results["float16"][2] * 2 == results["auto"][2]
    for kv in ("float16", "bfloat16"):
        for a, b in zip(results[kv][1], results["auto"][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0.05)


def test_dtype_choices_follow_vllm():
    from iterserve.model.config import parse_dtype
    assert parse_dtype("auto") is None and parse_dtype("half") == torch.float16
    assert parse_dtype("float") == torch.float32 and parse_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ModelLoadError, match="auto"):
        parse_dtype("float8")
