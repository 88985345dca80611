"""benchmarks/run_models.py and the roofline functions it uses (benchmarks/roofline.py).

The end-to-end test runs the script the way BENCHMARKS.md does, against a real `iterserve
serve` on a tiny random model (one server process, a 2-request `mix`, batch-1 decode and a
short TTFT prompt; ~10-15 s on a quiet machine, most of it server start-up: the one way to
check the script end to end), and checks the JSON and the table.
The rest checks the arithmetic the table rests on: weight bytes per token of tied and untied
files, the bound, medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "peers"))

import roofline  # noqa: E402
import run_models  # noqa: E402

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=512, rms_norm_eps=1e-5, rope_theta=1e4,
           max_position_embeddings=256)


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_per_token_counts_every_matrix_once_and_a_tied_table_as_the_head(
        tmp_path, tied):
    from gguf import GGUFReader
    from fixtures.tiny_gguf import write_random_llama_gguf
    path = tmp_path / "m.gguf"
    write_random_llama_gguf(path, {**CFG, "tie_word_embeddings": tied}, "Q4_0")
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    got = roofline.weight_bytes_per_token(path)
    if tied:        # the embedding table is the LM head: streamed once per token
        assert "output.weight" not in sizes and got == sum(sizes.values())
    else:           # untied: the head is streamed, the table only looked up
        assert got == sum(sizes.values()) - sizes["token_embd.weight"]
    # Q4_0: 18 bytes per 32 weights; the layers alone are a lower bound
    layer = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128
    assert got >= CFG["num_hidden_layers"] * layer * 18 // 32


def test_weight_bytes_of_an_hf_directory_skip_an_untied_embedding(tiny_model_dir):
    from iterserve.model.hf_loader import read_hf_weights
    d = tiny_model_dir                          # untied, float32
    refs = read_hf_weights(d)
    total = sum(r.nbytes for r in refs.values())
    embed = next(r.nbytes for n, r in refs.items() if n.endswith("embed_tokens.weight"))
    assert roofline.weight_bytes_per_token(d) == total - embed


def test_read_bandwidth_is_measured_per_thread_count():
    bw = roofline.read_bandwidth((1, 2), mb=32)
    assert set(bw) == {"1", "2"} and all(v > 0.1 for v in bw.values())


def test_resolve_model_names_the_cache_files():
    m = run_models.resolve_model("smollm2-1.7b:Q4_K_M")
    assert m.path.name == "smollm2-1.7b.Q4_K_M.gguf" and m.shape == "smollm2-1.7b"
    assert run_models.resolve_model("smollm2-1.7b:hf-bf16").path.name == "hf-bf16"
    assert run_models.resolve_model("llama-3.1-8b-like:blocks-Q4_K_M").path.name == \
        "llama-3.1-8b-like.blocks-Q4_K_M.gguf"
    with pytest.raises(SystemExit):
        run_models.resolve_model("nope:Q4_0")


def test_engine_variants_carry_their_flags():
    args = argparse.Namespace(
        engines=["iterserve", "llama-server"], iterserve_args="",
        iterserve_variants=["base=", "int8=--act-mode int8 --x 1",
                            "passive=OMP_WAIT_POLICY=PASSIVE --kv-cache-dtype float16"],
        llama_args="-fa on", vllm_args="")
    es = run_models.engines_from(args)
    assert [(e.label, e.extra, e.env) for e in es] == [
        ("iterserve [base]", [], {}),
        ("iterserve [int8]", ["--act-mode", "int8", "--x", "1"], {}),
        ("iterserve [passive]", ["--kv-cache-dtype", "float16"], {"OMP_WAIT_POLICY": "PASSIVE"}),
        ("llama-server", ["-fa", "on"], {})]


def test_summary_takes_medians_the_best_slot_count_and_the_bound_fraction():
    e = run_models.Engine("iterserve", "iterserve")
    m = run_models.ModelFile("x", Path("x.gguf"), None)
    samples = {"iterserve": {
        "s8": [{"mix": {"output_tok_s": 10.0}, "b1": {"decode_tok_s": 4.0},
                "ttft": {"ttft_ms": 900.0}},
               {"mix": {"output_tok_s": 12.0}, "b1": {"decode_tok_s": 6.0},
                "ttft": {"ttft_ms": 700.0}},
               {"mix": {"output_tok_s": 30.0}, "b1": {"decode_tok_s": 5.0},
                "ttft": {"ttft_ms": 800.0}}],
        "s16": [{"mix": {"output_tok_s": 14.0}}]}}
    rows = run_models.summarise(samples, [e], m, 8, [16], {"bound_tok_s_best": 10.0})
    r = rows["iterserve"]
    assert r["mix"] == 12.0 and r["mix_by_slots"] == {8: 12.0, 16: 14.0}
    assert (r["best"], r["best_slots"]) == (14.0, 16)
    assert r["b1_tok_s"] == 5.0 and r["ttft_ms"] == 800.0 and r["b1_fraction_of_bound"] == 0.5


def test_saturated_sweep_takes_each_engines_best_slot_count_and_compares_bests():
    """`sat`: per engine the best slot count; the ratio is best over the peer's best."""
    es = [run_models.Engine("iterserve", "iterserve"),
          run_models.Engine("llama-server", "llama-server")]
    m = run_models.ModelFile("x", Path("x.gguf"), None)
    tok = lambda v: {"sat": {"output_tok_s": v}}  # noqa: E731
    samples = {"iterserve": {"s4": [tok(20.0)], "s8": [tok(30.0), tok(32.0), tok(31.0)],
                             "s16": [tok(45.0)]},
               "llama-server": {"s4": [tok(25.0)], "s8": [tok(28.0)], "s16": [tok(27.0)]}}
    rows = run_models.summarise(samples, es, m, 8, [], None, [4, 8, 16])
    assert rows["iterserve"]["sat_by_slots"] == {4: 20.0, 8: 31.0, 16: 45.0}
    assert (rows["iterserve"]["sat_best"], rows["iterserve"]["sat_best_slots"]) == (45.0, 16)
    assert (rows["llama-server"]["sat_best"], rows["llama-server"]["sat_best_slots"]) == (28.0, 8)
    doc = {"files": [{"model": "x", "file": "x.gguf", "rows": rows, "notes": []}], "slots": 8,
           "ttft_prompt": 512, "machine": {}, "repeats": 1, "sat_window_s": 30.0}
    md = run_models.table(doc)
    assert "| iterserve | 20.0 | 31.0 | 45.0 | 45.0 (16) | 1.61x |" in md
    assert "| llama-server | 25.0 | 28.0 | 27.0 | 28.0 (8) | 1.00x |" in md


def test_run_models_end_to_end_on_a_tiny_model(tmp_path, tiny_model_dir):
    """The script as BENCHMARKS.md runs it: a real server, the same client, JSON + table."""
    model = tiny_model_dir
    out = tmp_path / "bench-tiny.json"
    rc = run_models.main(["--models", str(model), "--engines", "iterserve", "--measures",
                          "mix", "b1", "ttft", "sat", "--sat-slots", "8", "--sat-ramp-s", "0.5",
                          "--sat-window-s", "2", "--sat-min-completed", "1",
                          "--num-requests", "2", "--b1-tokens", "8",
                          "--ttft-prompt", "32", "--ttft-samples", "1", "--iterserve-args",
                          "--max-num-batched-tokens 64", "--bandwidth-mb", "64", "--out", str(out),
                          "--tag", "t"])
    assert rc == 0
    doc = json.loads(out.read_text())
    f = doc["files"][0]
    assert f["notes"] == [] and doc["bandwidth_gbs"]
    r = f["rows"]["iterserve"]
    assert r["mix"] > 0 and r["b1_tok_s"] > 0 and r["ttft_ms"] > 0
    bound = f["roofline"]["bound_tok_s_best"]
    assert r["b1_fraction_of_bound"] == pytest.approx(r["b1_tok_s"] / bound, rel=1e-2)
    sample = f["samples"]["iterserve"]["s8"][0]
    assert sample["mix"]["failed"] == 0 and "--max-num-batched-tokens 64" in sample["command"]
    # the bounded sweep, on the same server: a closed loop of 8, tokens counted in the window
    sat = sample["sat"]
    assert sat["failed"] == 0 and sat["chunks_in_window"] > 0 and sat["output_tok_s"] > 0
    # usage tokens per text chunk of the completed requests (> 1: the detokeniser held back
    # a random model's partial characters), so the figure counts tokens, not chunks
    assert 1.0 <= sat["tokens_per_chunk"] < 3.0 and sat["completed_requests"] > 0
    # under load the 2 s window may end before a request does: it is then extended until
    # one has (at most to 8 s), and the rate is over the window actually run
    assert 2.0 <= sat["window_s"] <= 8.5
    assert sat.get("window_extended", False) == (sat["window_s"] > 2.0)
    assert r["sat_by_slots"] == {"8": sat["output_tok_s"]} and r["sat_best_slots"] == 8
    md = out.with_suffix(".md").read_text()
    assert "| iterserve |" in md and "batch-1 bound" in md and "TTFT 32 ms" in md
    assert "Saturated (closed loop, 2.0 s window)" in md and "| 8 slots |" in md


def test_llama_server_command_is_the_peer_modules_one(tmp_path):
    """run_models and memory.py start llama-server through peers/llama_server.command (one
    place for its flags), with the engine's extra flags after them."""
    import llama_server as ls
    import memory
    m = run_models.ModelFile("tiny:Q4_0", tmp_path / "m.gguf", None)
    e = run_models.Engine("llama-server", "llama-server", extra=["-fa", "on"])
    binary = ls.BIN_DIR / "llama-server"
    cmd, _, health = run_models.server_command(e, m, 18700, 8, 512, {})
    assert cmd == ls.command(m.path, 18700, 8, 2, 512, binary) + ["-fa", "on"]
    assert cmd[cmd.index("-np") + 1] == "8" and cmd[cmd.index("-c") + 1] == str(8 * 512)
    assert health == "/health"
    assert memory.llama_server_command(m.path, 18701, 4, 256) == \
        ls.command(m.path, 18701, 4, 2, 256, binary)


def test_llama_server_build_names_the_isa_on_an_amx_cpu():
    """A native llama.cpp build segfaulted on an AMX Xeon; there the peer build names each ISA
    flag the CPU has and turns AMX off, elsewhere it stays GGML_NATIVE."""
    import llama_server as peer
    assert peer.isa_flags("flags\t: fpu avx2 fma f16c avx512f\n") == ["-DGGML_NATIVE=ON"]
    amx = peer.isa_flags("flags\t: fpu avx2 fma f16c avx512f avx512_vnni amx_tile amx_int8\n")
    assert "-DGGML_NATIVE=OFF" in amx and "-DGGML_AMX_INT8=OFF" in amx
    assert "-DGGML_AVX512=ON" in amx and "-DGGML_AVX512_VNNI=ON" in amx
    assert "-DGGML_AVX512_BF16=OFF" in amx


def test_weight_bytes_per_token_count_a_tokens_k_of_e_experts(tmp_path):
    """A Mixture-of-Experts token reads its k experts of E: the bound is over the active bytes."""
    from fixtures.tiny_models import make_tiny_model_dir
    from iterserve.model.hf_loader import read_hf_weights
    d = make_tiny_model_dir(tmp_path, "qwen3_moe")          # 4 experts, 2 a token
    sizes = {n: r.nbytes for n, r in read_hf_weights(d).items()}
    experts = sum(b for n, b in sizes.items() if ".experts." in n)
    embed = sum(b for n, b in sizes.items() if n.endswith("embed_tokens.weight"))
    assert experts > 0
    assert roofline.weight_bytes_per_token(d) == sum(sizes.values()) - embed - round(experts / 2)
