"""benchmarks/models.py and the peer setup's decisions, without building llama.cpp.

What is checked: the shapes are the real models' (hidden / layers / heads / KV heads /
intermediate / tied embeddings / q-k-v bias), the converter and llama-quantize command lines
(base type, --allow-requantize from a quantised base), the list of GGUF types it makes, the
HF writer's header and bias scale on a tiny shape, and that `llama_server.py setup` installs
its missing pins into its own folder (never the running venv) and puts it on the
subprocesses' PYTHONPATH only.
"""

import importlib.util
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name, rel):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


models = _load("bench_models_script", "benchmarks/models.py")
peer = _load("bench_llama_server_peer", "benchmarks/peers/llama_server.py")

# The published configs (config.json of each model on the HF hub), the fields that set size.
REAL = {
    "smollm2-360m": (960, 32, 15, 5, 2560, True, False),
    "smollm2-1.7b": (2048, 24, 32, 32, 8192, True, False),
    "llama-3.2-1b-like": (2048, 16, 32, 8, 8192, True, False),
    "qwen2.5-1.5b-like": (1536, 28, 12, 2, 8960, True, True),
    "llama-3.1-8b-like": (4096, 32, 32, 8, 14336, False, False),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_shapes_are_the_real_models(name):
    h, layers, heads, kv, inter, tied, bias = REAL[name]
    c = models.hf_config(name)
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["num_key_value_heads"], c["intermediate_size"], c["tie_word_embeddings"],
            c["attention_bias"]) == (h, layers, heads, kv, inter, tied, bias)
    assert c["vocab_size"] == 49152 and c["head_dim"] == h // heads
    shapes = models.tensor_shapes(name)
    d = h // heads
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (kv * d, h)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (h, inter)
    assert ("lm_head.weight" in shapes) == (not tied)
    assert ("model.layers.0.self_attn.q_proj.bias" in shapes) == bias
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes     # Qwen2: q/k/v only


def test_parameter_counts_match_the_model_names():
    count = {n: sum(int(np.prod(s)) for s in models.tensor_shapes(n).values()) for n in REAL}
    # 360M and 1.7B are SmolLM2's own vocabulary; the others use it instead of theirs, so
    # they are smaller than their names by (their vocab - 49152) x hidden (x2 untied).
    assert 0.35e9 < count["smollm2-360m"] < 0.37e9
    assert 1.70e9 < count["smollm2-1.7b"] < 1.72e9
    assert 7.3e9 < count["llama-3.1-8b-like"] < 7.5e9
    assert 1.0e9 < count["llama-3.2-1b-like"] < 1.1e9
    assert 1.3e9 < count["qwen2.5-1.5b-like"] < 1.45e9


def test_quant_types_are_the_common_gguf_types():
    assert set(models.QUANT_TYPES) == {"F16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K"}


def test_converter_and_quantize_command_lines(tmp_path):
    vendor, hf, out = tmp_path / "llama.cpp", tmp_path / "hf-bf16", tmp_path / "m.F16.gguf"
    cmd = models.converter_command("/py", vendor, hf, "F16", out)
    assert cmd[1:] == ["/py", str(vendor / "convert_hf_to_gguf.py"), str(hf),
                       "--outtype", "f16", "--outfile", str(out)]
    assert models.converter_command("/py", vendor, hf, "Q8_0", out)[5] == "q8_0"
    q = Path("/b/llama-quantize")
    assert models.quantize_command(q, out, "F16", tmp_path / "o.gguf", "Q4_K_M")[1:] == [
        str(q), str(out), str(tmp_path / "o.gguf"), "Q4_K_M", "2"]
    # from a quantised base llama-quantize refuses unless told to requantise
    assert "--allow-requantize" in models.quantize_command(q, out, "Q8_0", out, "Q4_K_M")
    assert "--allow-requantize" not in models.quantize_command(q, out, "BF16", out, "Q6_K")


def test_make_skips_existing_steps_and_drops_intermediates(tmp_path, monkeypatch):
    """With every output present nothing runs; with drop_intermediates the base goes."""
    monkeypatch.setattr(models, "CACHE", tmp_path)
    d = tmp_path / "smollm2-360m"
    d.mkdir()
    for t in ("Q8_0", "Q4_K_M"):
        (d / f"smollm2-360m.{t}.gguf").write_bytes(b"x")
    calls = []
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: calls.append(a))
    outs = models.make_llama_cpp_gguf("smollm2-360m", ["Q4_K_M"], base="Q8_0",
                                      drop_intermediates=True)
    assert [p.name for p in outs] == ["smollm2-360m.Q4_K_M.gguf"] and calls == []
    assert not (d / "smollm2-360m.Q8_0.gguf").exists()


def test_hf_writer_header_and_bias_scale(tmp_path, monkeypatch):
    """The streamed safetensors file: a valid header, bf16 tensors of the listed shapes,
    q/k/v biases drawn at BIAS_STD (so a dropped bias shows in `check`)."""
    shape = dict(model_type="qwen2", hidden_size=64, intermediate_size=128,
                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=True)
    monkeypatch.setitem(models.SHAPES, "tiny-qwen", shape)
    monkeypatch.setattr(models, "CACHE", tmp_path)
    monkeypatch.setattr(models, "save_tokenizer", lambda out: None)
    out = models.make_hf("tiny-qwen")
    raw = (out / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    assert set(header) - {"__metadata__"} == set(models.tensor_shapes("tiny-qwen"))

    def tensor(name):
        a, b = header[name]["data_offsets"]
        bits = np.frombuffer(data[a:b], dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(header[name]["shape"])

    assert header["model.layers.0.self_attn.q_proj.bias"]["dtype"] == "BF16"
    assert abs(tensor("model.layers.0.self_attn.q_proj.weight").std() - models.STD) < 0.004
    assert abs(tensor("model.layers.0.self_attn.q_proj.bias").std() - models.BIAS_STD) < 0.2
    assert (tensor("model.norm.weight") == 1).all()
    assert json.loads((out / "config.json").read_text())["attention_bias"] is True


def test_setup_installs_missing_pins_into_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(peer, "TOOLS_DIR", tmp_path / "pytools")
    have = {"scikit-build-core": "1.1.2", "sentencepiece": "0.1.99"}.get
    assert peer.missing_requirements(have=have) == ["sentencepiece==0.2.3"]
    assert peer.missing_requirements(have=lambda n: None) == list(peer.SETUP_REQUIREMENTS)
    cmd = peer.install_command(["sentencepiece==0.2.3"])
    assert cmd[:3] == [sys.executable, "-m", "pip"]
    assert cmd[cmd.index("--target") + 1] == str(tmp_path / "pytools")
    ran = []
    monkeypatch.setattr(peer, "missing_requirements", lambda: ["sentencepiece==0.2.3"])
    monkeypatch.setattr(peer, "_run", lambda c, **k: ran.append(c))
    peer.ensure_requirements()
    assert ran == [peer.install_command(["sentencepiece==0.2.3"])]
    # the folder reaches subprocesses through PYTHONPATH, not this interpreter's sys.path
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert peer.tools_env()["PYTHONPATH"].split(":") == [str(tmp_path / "pytools"), "/elsewhere"]
    assert str(tmp_path / "pytools") not in sys.path


def test_setup_reads_versions_from_its_folder(tmp_path, monkeypatch):
    """A pin installed into the tools folder counts as installed (no reinstall each run)."""
    tools = tmp_path / "pytools"
    dist = tools / "sentencepiece-0.2.3.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sentencepiece\nVersion: 0.2.3\n")
    monkeypatch.setattr(peer, "TOOLS_DIR", tools)
    assert peer._installed_version("sentencepiece", [str(tools)]) == "0.2.3"
    assert "sentencepiece==0.2.3" not in peer.missing_requirements()


def test_download_uses_the_sdist_without_build_isolation(tmp_path):
    cmd = peer.download_command(tmp_path)
    assert "--no-build-isolation" in cmd and "--no-binary" in cmd
    assert f"llama-cpp-python=={peer.LLAMA_CPP_PYTHON_VERSION}" in cmd


def test_qwen_shape_converts_through_the_pre_tokenizer_fallback(tmp_path):
    vendor, hf, out = tmp_path / "llama.cpp", tmp_path / "hf-bf16", tmp_path / "q.F16.gguf"
    cmd = models.converter_command("/py", vendor, hf, "F16", out, model_type="qwen2")
    assert cmd[1:6] == ["/py", str(ROOT / "benchmarks" / "models.py"), "convert",
                        "--pre-tokenizer", "qwen2"]
    assert cmd[6:] == [str(vendor / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16",
                       "--outfile", str(out)]
    # llama shapes call the converter itself
    assert models.converter_command("/py", vendor, hf, "F16", out, "llama")[2] == cmd[6]


def test_run_converter_names_an_unrecognised_pre_tokenizer(tmp_path, monkeypatch):
    """A stand-in for llama.cpp's tree (conversion/base.py + the script): the fallback names
    the pre-tokenizer only where the converter raises, and passes the arguments on."""
    (tmp_path / "conversion").mkdir()
    (tmp_path / "conversion" / "__init__.py").write_text("")
    (tmp_path / "conversion" / "base.py").write_text(
        "class TextModel:\n"
        "    def get_vocab_base_pre(self, tokenizer):\n"
        "        if tokenizer == 'known':\n"
        "            return 'smollm'\n"
        "        raise NotImplementedError('BPE pre-tokenizer was not recognized')\n")
    script = tmp_path / "convert_hf_to_gguf.py"
    script.write_text(
        "import sys\nfrom conversion.base import TextModel\n"
        "m = TextModel()\n"
        "open(sys.argv[-1], 'w').write(m.get_vocab_base_pre('known') + ' ' +\n"
        "                              m.get_vocab_base_pre('ours') + ' ' + sys.argv[1])\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    for mod in [m for m in sys.modules if m == "conversion" or m.startswith("conversion.")]:
        monkeypatch.delitem(sys.modules, mod)
    out = tmp_path / "out.txt"
    models.run_converter(script, "qwen2", ["HF", "--outfile", str(out)])
    assert out.read_text() == "smollm qwen2 HF"
    for mod in [m for m in sys.modules if m == "conversion" or m.startswith("conversion.")]:
        del sys.modules[mod]


def test_memory_table_marks_the_budget_and_the_load_ratio(tmp_path):
    def eng(peak, load):
        return {"ok": True, "peak_rss_bytes": peak, "load_s": load}
    doc = {"rows": [
        {"model": "m", "format": "Q4_K_M", "file_bytes": 1e9, "budget_bytes": 2e9,
         "engines": {"iterserve": eng(1.5e9, 10.0), "llama-server": eng(1.8e9, 5.0)}},
        {"model": "m", "format": "F16", "file_bytes": 3e9, "budget_bytes": 4e9,
         "engines": {"iterserve": eng(4.5e9, 6.0),
                     "llama-server": {"ok": False, "error": "exited"}}},
        {"format": "Q6_K", "ok": False, "error": "missing"}]}
    (tmp_path / "a.json").write_text(json.dumps(doc))
    lines = models.memory_table([tmp_path / "a.json"]).splitlines()
    assert len(lines) == 4
    assert lines[2].endswith("| 1.50 GB / 10.0 s | 1.80 GB / 5.0 s | - | yes | 2.00 |")
    assert "| NO | - |" in lines[3]          # over budget; the failed peer gives no ratio
