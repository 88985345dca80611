"""Embedding models through the engine: vectors equal sentence-transformers' and HF's on
the same tiny checkpoint, for every pooling type, chunked or whole, batched with other
requests, preempted, with prefix caching; and no KV block outlives its request."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fixtures.tiny_embedders import make_st_embedder
from iterserve.core.request import PoolingParams, SamplingParams
from iterserve.engine.args import EngineArgs
from iterserve.engine.llm_engine import LLMEngine
from iterserve.errors import ConfigError, InvalidRequestError, WrongRunnerError

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 6, "a",
         "Once upon a time there was a little model that wanted to answer questions."]


def _engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 256)
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), **kw))


def _run(engine: LLMEngine, prompts, params=None) -> list[np.ndarray]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params or PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks        # every block back in the pool
    engine.scheduler.check_consistency()
    return [done[f"r{i}"].embedding for i in range(len(prompts))]


def _st(model_dir, texts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer
        return SentenceTransformer(str(model_dir), device="cpu").encode(texts)


@pytest.mark.parametrize("pooling,normalize,old", [
    ("LAST", True, True), ("MEAN", False, True), ("CLS", True, False), ("MAX", False, False),
    ("MEAN", True, False)])
def test_vectors_equal_sentence_transformers(tmp_path, pooling, normalize, old):
    """A small token budget splits the long text into chunks; every vector matches."""
    d = make_st_embedder(tmp_path, pooling=pooling, normalize=normalize, old_format=old)
    engine = _engine(d, max_num_batched_tokens=16)
    assert engine.pooler_config.pooling_type == pooling
    assert engine.pooler_config.normalize is normalize
    ours = _run(engine, TEXTS)
    ref = _st(d, TEXTS)
    for a, b in zip(ours, ref):
        assert a.dtype == np.float32 and a.shape == (64,)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_last_token_equals_hf_transformers(tmp_path):
    """The Qwen3-Embedding recipe by hand: AutoModel's last hidden state at the last
    token, L2-normalised; token-id prompts as well as text."""
    from transformers import AutoModel
    d = make_st_embedder(tmp_path, pooling="LAST", arch="qwen2", name="gte")
    engine = _engine(d, max_num_batched_tokens=8)
    ids = [engine.tokenize_prompt(t) for t in TEXTS]
    ours = _run(engine, ids)
    hf = AutoModel.from_pretrained(d, dtype=torch.float32).eval()
    for a, x in zip(ours, ids):
        with torch.no_grad():
            h = hf(input_ids=torch.tensor([x])).last_hidden_state[0, -1]
        np.testing.assert_allclose(a, torch.nn.functional.normalize(h, dim=-1).numpy(),
                                   rtol=1e-4, atol=2e-5)


def test_prefix_cache_and_preemption_keep_the_vectors(tmp_path):
    """Last-token pooling takes prefix-cache hits (the shared prefix is computed once);
    mean pooling takes none. A pool too small for all at once preempts (recompute) and
    the vectors stay those of a roomy engine."""
    shared = "The cache is split into blocks of sixteen tokens, and a block table maps. "
    texts = [shared * 3 + t for t in TEXTS]
    for pooling in ("LAST", "MEAN"):
        d = make_st_embedder(tmp_path, pooling=pooling, name=f"pc-{pooling}")
        roomy = _run(_engine(d, enable_prefix_caching=False), texts)
        cached = _engine(d, max_num_batched_tokens=32)
        got = _run(cached, texts)
        hit_rate = cached.scheduler.stats().prefix_cache_hit_rate
        assert (hit_rate > 0) is (pooling == "LAST"), hit_rate
        tight = _engine(d, num_kv_blocks=30, block_size=8, max_num_batched_tokens=64,
                        max_num_partial_prefills=4, long_prefill_token_threshold=16,
                        enable_prefix_caching=False)
        small = _run(tight, texts)
        assert tight.scheduler.stats().num_preemptions_total > 0
        for a, b, c in zip(roomy, got, small):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


def test_matryoshka_dimensions(tmp_path):
    d = make_st_embedder(tmp_path, name="plain")
    engine = _engine(d)
    with pytest.raises(InvalidRequestError, match="matryoshka") as e:
        engine.add_request("x", "hello", PoolingParams(dimensions=16))
    assert e.value.param == "dimensions"
    full = _run(engine, ["hello world"])[0]
    m = make_st_embedder(tmp_path, name="mrl", matryoshka_dimensions=[16, 32, 64])
    engine = _engine(m)
    with pytest.raises(InvalidRequestError, match=r"\[16, 32, 64\]"):
        engine.add_request("x", "hello", PoolingParams(dimensions=20))
    cut = _run(engine, ["hello world"], PoolingParams(dimensions=16))[0]
    assert cut.shape == (16,)
    # truncated, then normalised (vLLM's order); the same weights as `plain`
    raw = _run(_engine(m, pooler_config={"normalize": False}), ["hello world"])[0]
    np.testing.assert_allclose(cut, raw[:16] / np.linalg.norm(raw[:16]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(full, raw / np.linalg.norm(raw), rtol=1e-5, atol=1e-6)
    # --hf-overrides makes a model Matryoshka (any size up to the hidden size)
    over = _engine(d, hf_overrides={"is_matryoshka": True})
    assert _run(over, ["hello world"], PoolingParams(dimensions=8))[0].shape == (8,)


def test_wrong_runner_and_bad_input(tmp_path):
    d = make_st_embedder(tmp_path)
    engine = _engine(d, max_model_len=32)
    with pytest.raises(WrongRunnerError, match="embedding model"):
        engine.add_request("g", "hello", SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request("long", list(range(3, 36)), PoolingParams())
    # a prompt of exactly max_model_len tokens is embedded (nothing is generated after it)
    assert _run(engine, [list(range(3, 35))])[0].shape == (64,)
    gen = _engine(d, runner="generate")
    assert gen.pooler_config is None
    with pytest.raises(WrongRunnerError, match="text generation"):
        gen.add_request("e", "hello", PoolingParams())


def test_runner_flags(tmp_path):
    from fixtures.tiny_models import make_tiny_model_dir
    causal = make_tiny_model_dir(tmp_path, "llama")         # LlamaForCausalLM, no ST files
    assert _engine(causal).pooler_config is None
    for kw in ({"runner": "pooling"}, {"convert": "embed"}, {"task": "embed"}):
        cfg = _engine(causal, **kw).pooler_config
        assert (cfg.pooling_type, cfg.normalize) == ("LAST", True)     # vLLM's default
    cfg = _engine(causal, runner="pooling", pooler_config={"pooling_type": "mean"}).pooler_config
    assert cfg.pooling_type == "MEAN"
    with pytest.raises(ConfigError, match="pooler-config"):
        _engine(causal, pooler_config={"pooling_type": "mean"})
    with pytest.raises(ConfigError, match="classification"):
        _engine(causal, convert="classify")


def test_offline_llm_embed(tmp_path):
    from iterserve import LLM, PoolingParams as TopLevel
    d = make_st_embedder(tmp_path, pooling="MEAN", normalize=False)
    llm = LLM(str(d), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=16)
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert TopLevel is PoolingParams
    for o, b in zip(outs, _st(d, TEXTS)):
        assert o.finished and o.outputs == []
        np.testing.assert_allclose(o.embedding, b, rtol=1e-4, atol=2e-5)
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        llm.embed(["ok", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_refused_checkpoints(tmp_path):
    """What the embedding path would serve differently from sentence-transformers is
    refused at start, naming the file: a Dense module, several pooling modes, inputs
    rendered through a chat template (unless --pooler-config takes over)."""
    import json
    d = make_st_embedder(tmp_path, name="dense")
    modules = json.loads((d / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense",
                    "type": "sentence_transformers.models.Dense"})
    (d / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="'Dense'"):
        _engine(d)
    d = make_st_embedder(tmp_path, name="two", old_format=False)
    cfg = json.loads((d / "1_Pooling" / "config.json").read_text())
    (d / "1_Pooling" / "config.json").write_text(json.dumps({**cfg, "pooling_mode": ["mean", "max"]}))
    with pytest.raises(ConfigError, match="pooling"):
        _engine(d)
    d = make_st_embedder(tmp_path, name="chat")
    (d / "sentence_bert_config.json").write_text(json.dumps(
        {"modality_config": {"text": {}, "message": {"format": "flat"}}}))
    with pytest.raises(ConfigError, match="chat template"):
        _engine(d)
    assert _engine(d, pooler_config={"pooling_type": "LAST"}).pooler_config.pooling_type == "LAST"
