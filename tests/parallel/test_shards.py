"""model/parallel.py without processes: each rank's slice of a tensor, read in the file's
encoding, decodes to the same numbers as the slice of the whole tensor, and models that
cannot be split are refused before any weight is read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures.tiny_gguf import ALL_QUANT, TINY_LLAMA, write_tiny_llama_gguf
from iterserve.errors import ModelLoadError
from iterserve.model.config import ModelConfig
from iterserve.model.gguf_loader import load_gguf
from iterserve.model.parallel import (KShardRef, Shard, k_shard, k_splits, row_shard,
                                      vocab_range)
from iterserve.model.weights import EncodedWeight


@pytest.fixture(scope="module")
def mixed_refs(tmp_path_factory):
    """The loader tests' GGUF: F32 q, F16 k, Q4_0 v, Q4_1 o, Q5_0 gate, Q8_0 up, Q4_K/Q6_K
    down, Q8_0 embeddings, F16 LM head (llama: Q/K rows permuted in the file)."""
    path = tmp_path_factory.mktemp("shards") / "mixed.gguf"
    write_tiny_llama_gguf(path, seed=5)
    config, refs, _ = load_gguf(path)
    return ModelConfig.from_hf(config), refs


@pytest.mark.parametrize("world", [2, 4])
def test_row_slices_are_byte_ranges_that_decode_to_the_rows(mixed_refs, world):
    _, refs = mixed_refs
    for name in ("model.layers.0.self_attn.q_proj.weight",    # F32, permuted rows
                 "model.layers.0.self_attn.k_proj.weight",    # F16, permuted rows
                 "model.layers.0.self_attn.v_proj.weight",    # Q4_0
                 "model.layers.0.mlp.gate_proj.weight",       # Q5_0
                 "model.embed_tokens.weight"):                # Q8_0
        ref = refs[name]
        if world == 4 and "k_proj" in name:
            with pytest.raises(ModelLoadError, match="crosses"):   # 2 KV heads: half a head
                row_shard(ref, 0, ref.shape[0] // 4)
            continue
        full = ref.to_float()
        rows = ref.shape[0] // world
        for r in range(world):
            part = row_shard(ref, r * rows, (r + 1) * rows)
            assert part.ggml_type == ref.ggml_type and part.nbytes == ref.nbytes // world
            torch.testing.assert_close(part.to_float(), full[r * rows:(r + 1) * rows],
                                       rtol=0, atol=0)


def test_k_slices_stay_encoded_when_whole_blocks_else_the_rows_are_split(mixed_refs):
    full_cfg, refs = mixed_refs
    o = refs["model.layers.0.self_attn.o_proj.weight"]          # Q4_1, K 64 -> 32 per rank
    down = refs["model.layers.0.mlp.down_proj.weight"]          # Q4_K, K 256 -> 128 per rank
    assert k_splits(o, 2) and not k_splits(down, 2)
    full = o.to_float()
    half = o.k // 2
    for r in range(2):
        part = k_shard(o, r, 2)
        assert isinstance(part, KShardRef)
        assert part.ggml_type == o.ggml_type and part.nbytes == o.nbytes // 2
        torch.testing.assert_close(part.to_float(), full[:, r * half:(r + 1) * half],
                                   rtol=0, atol=0)
        w = EncodedWeight.fuse([part])                          # what Linear.set_weight gets
        torch.testing.assert_close(w.dequantize(), full[:, r * half:(r + 1) * half],
                                   rtol=0, atol=0)
    with pytest.raises(ModelLoadError, match="not whole Q4_K blocks"):
        k_shard(down, 0, 2)
    # a K slice that is not whole blocks: the rank keeps whole-K rows, still encoded
    full = down.to_float()
    rows = down.shape[0] // 2
    for r in range(2):
        part = Shard(r, 2).refs(refs, full_cfg)["model.layers.0.mlp.down_proj.weight"]
        assert part.ggml_type == down.ggml_type and part.shape == (rows, down.k)
        torch.testing.assert_close(part.to_float(), full[r * rows:(r + 1) * rows], rtol=0, atol=0)


def test_rank_slices_of_every_tensor_have_the_local_shapes(mixed_refs):
    full, refs = mixed_refs
    for r in range(2):
        shard = Shard(r, 2)
        local = shard.config(full)
        assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 128)
        assert local.head_dim == full.head_dim and local.vocab_size == full.vocab_size
        out = shard.refs(refs, full)
        d = full.head_dim
        p = "model.layers.1."
        assert out[p + "self_attn.q_proj.weight"].shape == (2 * d, 64)
        assert out[p + "self_attn.k_proj.weight"].shape == (d, 64)
        assert out[p + "self_attn.o_proj.weight"].shape == (64, 2 * d)
        assert out[p + "mlp.up_proj.weight"].shape == (128, 64)
        assert out[p + "mlp.down_proj.weight"].shape == (32, 256)   # Q4_K: rows, whole K
        assert out["model.embed_tokens.weight"].shape == (256, 64)
        assert out[p + "input_layernorm.weight"] is refs[p + "input_layernorm.weight"]


def test_uneven_vocabulary_ranges_cover_it_once():
    for v, n in ((512, 2), (511, 2), (1001, 4), (5, 4)):
        ranges = [vocab_range(v, r, n) for r in range(n)]
        assert ranges[0][0] == 0 and ranges[-1][1] == v
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_models_that_cannot_be_split_are_refused(mixed_refs):
    full, refs = mixed_refs
    with pytest.raises(ModelLoadError, match="does not divide the model's num_key_value_heads"):
        Shard(0, 4).refs(refs, full)                            # 2 KV heads over 4 ranks
    with pytest.raises(ModelLoadError, match="num_attention_heads"):
        Shard(0, 3).config(full)
    gpt2 = ModelConfig.from_hf({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                "vocab_size": 512, "n_positions": 128})
    with pytest.raises(ModelLoadError, match="tensor parallel supports"):
        Shard(0, 2).check(gpt2)


def test_all_quant_file_splits_on_block_boundaries(tmp_path):
    """The all-quantised fixture's shapes are block-aligned at TP=2: nothing is widened."""
    path = tmp_path / "q.gguf"
    write_tiny_llama_gguf(path, seed=3, tensor_types=ALL_QUANT)
    config, refs, _ = load_gguf(path)
    out = Shard(1, 2).refs(refs, ModelConfig.from_hf(config))
    assert all(k_splits(refs[n], 2) for n in refs if n.endswith(("o_proj.weight",
                                                                 "down_proj.weight")))
    assert sum(isinstance(r, KShardRef) for r in out.values()) == 2 * TINY_LLAMA["num_hidden_layers"]
    perm = out["model.layers.0.self_attn.q_proj.weight"].row_perm
    assert perm is not None and sorted(np.asarray(perm).tolist()) == list(range(len(perm)))


def test_the_engine_refuses_before_starting_any_rank(tmp_path):
    """-tp 4 on 2 KV heads: refused from the config, with the reason, and no process spawned."""
    import multiprocessing

    from iterserve import LLM

    path = tmp_path / "q.gguf"
    write_tiny_llama_gguf(path, seed=3, tensor_types=ALL_QUANT)
    with pytest.raises(ModelLoadError, match=r"does not divide the model's "
                                             r"num_key_value_heads \(2\)"):
        LLM(str(path), tensor_parallel_size=4, num_kv_blocks=16)
    assert not multiprocessing.active_children()
