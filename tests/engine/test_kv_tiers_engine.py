"""KV tiers through the offline engine, on a real (tiny, dense float32) model file: a prompt
served warm from a disk tier a previous engine wrote gives exactly the cold answer's tokens;
torn and corrupt files are recomputed with a warning; another model, block size or KV dtype
never reads the tier; a full disk only costs hits; an evicted prefix comes back from the RAM
tier; two processes share one directory.

The greedy comparisons run with float activations on a float32 checkpoint, where a prefix
served from the cache gives the same logits as computed ones up to summation order (the
tokens are equal); bitwise logits across batch shapes are the batch-invariance work's."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from iterserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
KW = dict(max_model_len=256, block_size=4, kernel_activations="float")


def prompts(n=3, length=70, shared=40):
    """Prompts sharing a `shared`-token prefix (a system prompt), each its own tail."""
    head = [3 + (i * 7) % 400 for i in range(shared)]
    return [{"prompt_token_ids": head + [5 + (j * 31 + i * 13) % 400
                                         for i in range(length - shared)]}
            for j in range(n)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def files(d: Path) -> list[Path]:
    return sorted(d.rglob("*.kv"))


@pytest.fixture(scope="module")
def cold(tiny_model_dir):
    """The answers of an engine with no tiers at all and no prefix cache."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=128, enable_prefix_caching=False, **KW)
    return tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))


def engine(model, d, **kw):
    return LLM(str(model), num_kv_blocks=kw.pop("num_kv_blocks", 128),
               kv_offload_dir=str(d) if d else None, **{**KW, **kw})


def test_a_restarted_engine_answers_warm_from_disk_with_the_cold_tokens(tiny_model_dir, tmp_path,
                                                                         cold):
    first = engine(tiny_model_dir, tmp_path)
    assert tokens(first.generate(prompts(), GREEDY, use_tqdm=False)) == cold
    first.engine.shutdown()                   # writes what is still queued
    # 10 blocks of the shared head, then each 9 of its own (77 tokens computed: 19 blocks)
    assert len(files(tmp_path)) == 10 + 3 * 9
    second = engine(tiny_model_dir, tmp_path)
    assert second.engine.stats()["memory"]["kv_tiers"]["disk"]["found_blocks"] \
        == len(files(tmp_path))
    outs = second.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(outs) == cold
    assert [o.num_cached_tokens for o in outs] == [68, 68, 68]       # all but the last block
    st = second.engine.stats()["kv_tiers"]
    # the first reads its 17 blocks; the others share the head and read their own 7
    assert st["counters"]["disk_hits"] == 17 + 2 * 7 == st["store"]["reads"]
    assert st["counters"]["failed_reads"] == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_torn_or_corrupt_files_are_recomputed_with_a_warning_never_wrong(
        tiny_model_dir, tmp_path, cold, caplog, damage):
    first = engine(tiny_model_dir, tmp_path)
    first.generate(prompts(), GREEDY, use_tqdm=False)
    first.engine.shutdown()
    for i, f in enumerate(files(tmp_path)):
        if i % 2:
            continue
        data = f.read_bytes()
        f.write_bytes({"flip": data[:-3] + bytes([data[-3] ^ 0x40]) + data[-2:],
                       "truncate": data[:len(data) - 100], "empty": b""}[damage])
    second = engine(tiny_model_dir, tmp_path)
    with caplog.at_level(logging.WARNING, logger="iterserve.model.kv_tier_store"):
        outs = second.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(outs) == cold
    st = second.engine.stats()["kv_tiers"]
    assert st["counters"]["failed_reads"] > 0
    assert "recomputed" in caplog.text
    second.engine.shutdown()
    third = engine(tiny_model_dir, tmp_path)     # the bad files are gone or rewritten
    assert tokens(third.generate(prompts(), GREEDY, use_tqdm=False)) == cold
    assert third.engine.stats()["kv_tiers"]["counters"]["failed_reads"] == 0


@pytest.mark.parametrize("change", [dict(block_size=8), dict(kv_cache_dtype="float16"),
                                    dict(kernel_activations="int8"), "model"])
def test_another_model_block_size_or_kv_dtype_never_reads_the_tier(tiny_model_dir, tmp_path,
                                                                   change):
    from fixtures.tiny_models import make_tiny_model_dir
    first = engine(tiny_model_dir, tmp_path)
    first.generate(prompts(), GREEDY, use_tqdm=False)
    first.engine.shutdown()
    if change == "model":     # the same shape and config, other weights
        other = engine(make_tiny_model_dir(tmp_path / "other", seed=1), tmp_path)
    else:
        other = engine(tiny_model_dir, tmp_path, **change)
    assert other.engine.stats()["memory"]["kv_tiers"]["disk"]["found_blocks"] == 0
    outs = other.generate(prompts(), GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens == 0            # the first sees nothing from disk
    assert other.engine.stats()["kv_tiers"]["counters"]["disk_hits"] == 0


def test_a_full_disk_costs_hits_not_answers(tiny_model_dir, tmp_path, cold, monkeypatch,
                                            caplog):
    import errno

    from iterserve.model.kv_tier_store import DiskStore

    def full(self, digest, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskStore, "write", full)
    llm = engine(tiny_model_dir, tmp_path)
    with caplog.at_level(logging.WARNING):
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == cold
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    st = llm.engine.stats()["kv_tiers"]
    assert st["counters"]["failed_writes"] > 0 and st["disk"]["used"] == 0
    assert "No space left" in caplog.text
    assert not files(tmp_path)


def test_the_disk_bound_evicts_the_least_recently_used_files(tiny_model_dir, tmp_path):
    llm = engine(tiny_model_dir, tmp_path, num_disk_tier_blocks=20, num_ram_tier_blocks=20)
    for p in prompts(n=4):
        llm.generate(p, GREEDY, use_tqdm=False)
    llm.engine.shutdown()
    assert len(files(tmp_path)) == 20
    st = llm.engine.stats()["kv_tiers"]
    assert st["disk"]["used"] == 20 and st["counters"]["disk_deletes"] > 0


def test_an_evicted_prefix_comes_back_from_the_ram_tier(tiny_model_dir, cold):
    # A pool of 40 blocks holds one 70-token prompt's blocks and a little more: the others
    # evict it. The RAM tier keeps what the pool evicts.
    llm = engine(tiny_model_dir, None, num_kv_blocks=40, num_ram_tier_blocks=80)
    ps = prompts()
    assert tokens(llm.generate(ps, GREEDY, use_tqdm=False)) == cold
    flood = [{"prompt_token_ids": [9 + (i * j) % 300 for i in range(120)]} for j in (3, 5)]
    llm.generate(flood, GREEDY, use_tqdm=False)
    outs = llm.generate(ps[0], GREEDY, use_tqdm=False)
    assert tokens(outs) == cold[:1] and outs[0].num_cached_tokens == 68
    st = llm.engine.stats()["kv_tiers"]
    assert st["counters"]["ram_saves"] > 0 and st["counters"]["ram_hits"] > 0


_WORKER = textwrap.dedent("""
    import json, sys
    from iterserve import LLM, SamplingParams
    model, d, seed, out = sys.argv[1:5]
    head = [3 + (i * 7) % 400 for i in range(40)]
    ps = [{"prompt_token_ids": head + [5 + (j * 31 + i * 13 + int(seed) * 101) % 400
                                       for i in range(30)]} for j in range(6)]
    llm = LLM(model, num_kv_blocks=128, max_model_len=256, block_size=4,
              kernel_activations="float", kv_offload_dir=d)
    res = llm.generate(ps, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    llm.engine.shutdown()
    json.dump({"tokens": [o.outputs[0].token_ids for o in res],
               "cached": [o.num_cached_tokens for o in res],
               "stats": llm.engine.stats()["kv_tiers"]["counters"]}, open(out, "w"))
""")


def test_two_processes_share_one_directory(tiny_model_dir, tmp_path):
    """Two engines write the same directory at once (the shared system prompt's blocks by
    both), then each serves the other's prompts warm from it."""
    import json
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    d = tmp_path / "kv"

    def start(seed, tag):
        return subprocess.Popen([sys.executable, str(script), str(tiny_model_dir), str(d),
                                 str(seed), str(tmp_path / f"{tag}.json")],
                                env={**os.environ, "OMP_NUM_THREADS": "1"})

    procs = [start(0, "a"), start(1, "b")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    a, b = (json.loads((tmp_path / f"{t}.json").read_text()) for t in "ab")
    assert not list(d.rglob("*.tmp"))
    procs = [start(1, "a2"), start(0, "b2")]          # each the other's prompts
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    a2, b2 = (json.loads((tmp_path / f"{t}.json").read_text()) for t in ("a2", "b2"))
    assert a2["tokens"] == b["tokens"] and b2["tokens"] == a["tokens"]
    assert a2["cached"][0] == 68 and b2["cached"][0] == 68      # warm from the other's files
    assert a2["stats"]["failed_reads"] == b2["stats"]["failed_reads"] == 0


def test_a_load_found_bad_in_its_own_step_is_recomputed_in_that_forward_pass(
        tiny_model_dir, tmp_path, cold, monkeypatch):
    """A corrupt file whose read is still running when the request is admitted: its RAM load
    finds the slot bad only in the step that needs it, so the runner starts the chunk at the
    bad block and computes it again in that very forward pass (and the request sharing the
    block in the same step reads the recomputed values)."""
    import time

    from iterserve.model.kv_tier_store import KVTierStore
    from iterserve.model.runner import ModelRunner

    first = engine(tiny_model_dir, tmp_path)
    first.generate(prompts(), GREEDY, use_tqdm=False)
    first.engine.shutdown()
    for f in files(tmp_path):
        f.write_bytes(f.read_bytes()[:-1] + b"\x00")
    real_read = KVTierStore._read
    monkeypatch.setattr(KVTierStore, "_read",
                        lambda self, d, s: (time.sleep(0.3), real_read(self, d, s))[1])
    starts = []
    real = ModelRunner._recompute_bad_blocks

    def spy(self, chunks, bad, recomputed):
        out = real(self, chunks, bad, recomputed)
        starts.append([(st.req_id, start) for st, start, _ in out])
        return out

    monkeypatch.setattr(ModelRunner, "_recompute_bad_blocks", spy)
    second = engine(tiny_model_dir, tmp_path)
    outs = second.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(outs) == cold
    assert starts and any(start == 0 for step in starts for _, start in step)
    assert second.engine.stats()["kv_tiers"]["counters"]["invalid_blocks"] == 0
