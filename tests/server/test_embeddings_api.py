"""/v1/embeddings, /v1/score and /rerank on a real server, through the official `openai`
client and langchain-openai's OpenAIEmbeddings; bad input is a 4xx with an OpenAI body;
a generation request to an embedding server (and the reverse) is a 400."""

from __future__ import annotations

import base64
import warnings

import httpx
import numpy as np
import openai
import pytest

from fixtures.tiny_embedders import make_st_embedder
from server.conftest import _start

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a"]


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory):
    return make_st_embedder(tmp_path_factory.mktemp("emb"), pooling="MEAN",
                            matryoshka_dimensions=[16, 32, 64])


@pytest.fixture(scope="module")
def emb_server(embed_dir):
    s = _start(embed_dir, max_num_batched_tokens=16, max_model_len=64,
               debug_check_consistency=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(emb_server):
    return openai.OpenAI(base_url=emb_server.v1, api_key="none", max_retries=0)


def _reference(embed_dir, texts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer
        return SentenceTransformer(str(embed_dir), device="cpu").encode(texts)


def test_openai_client_embeddings(client, emb_server, embed_dir):
    ref = _reference(embed_dir, TEXTS)
    r = client.embeddings.create(model=emb_server.model, input=TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, b in zip(r.data, ref):
        np.testing.assert_allclose(d.embedding, b, rtol=1e-4, atol=2e-5)
    tok = emb_server.engine.tokenizer
    n = sum(len(tok.encode(t)) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n
    one = client.embeddings.create(model=emb_server.model, input=TEXTS[1])
    np.testing.assert_allclose(one.data[0].embedding, ref[1], rtol=1e-4, atol=2e-5)
    # token ids, and lists of them
    ids = [tok.encode(t) for t in TEXTS]
    r = client.embeddings.create(model=emb_server.model, input=ids[0])
    np.testing.assert_allclose(r.data[0].embedding, ref[0], rtol=1e-4, atol=2e-5)
    r = client.embeddings.create(model=emb_server.model, input=ids)
    for d, b in zip(r.data, ref):
        np.testing.assert_allclose(d.embedding, b, rtol=1e-4, atol=2e-5)


def test_base64_and_dimensions(client, emb_server, embed_dir):
    ref = _reference(embed_dir, TEXTS)
    # the client asks for base64 by default when no format is given and decodes it itself
    raw = httpx.post(emb_server.v1 + "/embeddings",
                     json={"input": TEXTS, "encoding_format": "base64"}).json()
    for d, b in zip(raw["data"], ref):
        v = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        np.testing.assert_allclose(v, b, rtol=1e-4, atol=2e-5)
    r = client.embeddings.create(model=emb_server.model, input=TEXTS, dimensions=16)
    for d, b in zip(r.data, ref):
        assert len(d.embedding) == 16        # truncated, then normalised again
        np.testing.assert_allclose(d.embedding, b[:16] / np.linalg.norm(b[:16]),
                                   rtol=1e-4, atol=2e-5)


def test_langchain_openai_embeddings(emb_server, embed_dir):
    from langchain_openai import OpenAIEmbeddings
    emb = OpenAIEmbeddings(model=emb_server.model, base_url=emb_server.v1, api_key="none",
                           check_embedding_ctx_length=False, max_retries=0)
    ref = _reference(embed_dir, TEXTS)
    docs = emb.embed_documents(TEXTS)
    for a, b in zip(docs, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(emb.embed_query(TEXTS[0]), ref[0], rtol=1e-4, atol=2e-5)


def test_score_and_rerank(emb_server, embed_dir):
    ref = _reference(embed_dir, ["hello world", *TEXTS])

    def cos(a, b):
        return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))

    for path in ("/score", "/v1/score"):
        r = httpx.post(emb_server.base_url + path,
                       json={"text_1": "hello world", "text_2": TEXTS})
        assert r.status_code == 200, r.text
        scores = [d["score"] for d in r.json()["data"]]
        assert scores == pytest.approx([cos(ref[0], v) for v in ref[1:]], abs=1e-5)
    want = sorted(range(3), key=lambda i: -cos(ref[0], ref[1 + i]))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(emb_server.base_url + path,
                       json={"query": "hello world", "documents": TEXTS, "top_n": 2})
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert [x["index"] for x in res] == want[:2]
        assert res[0]["document"]["text"] == TEXTS[want[0]]
        assert res[0]["relevance_score"] == pytest.approx(cos(ref[0], ref[1 + want[0]]), abs=1e-5)


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, emb_server):
    """vLLM's truncate_prompt_tokens on the pooling routes: an input longer than
    max_model_len (64) is embedded from its last k tokens (-1: the last 64)."""
    long = " ".join(f"word{i}" for i in range(100))
    ids = emb_server.engine.tokenizer.encode(long)
    assert len(ids) > 64
    for k, keep in ((8, 8), (-1, 64)):
        want = client.embeddings.create(model=emb_server.model, input=ids[-keep:])
        for given in ([long, long], [ids, ids]):        # text, and token ids
            r = client.embeddings.create(model=emb_server.model, input=given,
                                         extra_body={"truncate_prompt_tokens": k})
            for d in r.data:
                np.testing.assert_allclose(d.embedding, want.data[0].embedding, rtol=1e-5,
                                           atol=1e-6)
            assert r.usage.prompt_tokens == 2 * keep
    r = httpx.post(emb_server.base_url + "/rerank", json={
        "query": long, "documents": [long, "a"], "truncate_prompt_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 8 + 8 + len(
        emb_server.engine.tokenizer.encode("a"))
    r = httpx.post(emb_server.v1 + "/embeddings", json={"input": "hi",
                                                          "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": "x " * 200}, "input"),                 # over max_model_len (64)
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [10**6]}, "prompt"),                   # outside the vocabulary
    ({"input": "hi", "dimensions": 20}, "dimensions"),  # not one of [16, 32, 64]
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "model": "other"}, "model"),
    ({"input": "hi", "bogus": 1}, "bogus"),
])
def test_bad_input_is_a_4xx(emb_server, body, param):
    r = httpx.post(emb_server.v1 + "/embeddings", json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param, err
    bm = emb_server.engine.engine.scheduler.block_manager
    assert not emb_server.engine.engine.scheduler.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks


def test_generation_refused_on_an_embedding_server(client, emb_server):
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=emb_server.model, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=emb_server.model, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.responses.create(model=emb_server.model, input="hi")
    r = httpx.post(emb_server.base_url + "/v1/messages", json={
        "model": emb_server.model, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]


def test_embeddings_refused_on_a_generation_server(embed_dir):
    s = _start(embed_dir, runner="generate", max_model_len=64)
    try:
        c = openai.OpenAI(base_url=s.v1, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="text generation") as e:
            c.embeddings.create(model=s.model, input="hi")
        assert e.value.body["code"] == "model_not_supported"
        for path, body in (("/v1/score", {"text_1": "a", "text_2": "b"}),
                           ("/rerank", {"query": "a", "documents": ["b"]})):
            r = httpx.post(s.base_url + path, json=body)
            assert r.status_code == 400 and "text generation" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_dimensions_refused_on_a_model_without_matryoshka(tmp_path):
    s = _start(make_st_embedder(tmp_path, name="plain"), max_model_len=64)
    try:
        c = openai.OpenAI(base_url=s.v1, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="matryoshka"):
            c.embeddings.create(model=s.model, input="hi", dimensions=16)
        assert len(c.embeddings.create(model=s.model, input="hi").data[0].embedding) == 64
    finally:
        s.stop()


def test_iterserve_serve_runner_pooling_on_a_causal_checkpoint(tiny_model_dir):
    """`iterserve serve MODEL --runner pooling --pooler-config ...` as a process, on a
    causal LM without sentence-transformers files: mean pooling of HF's last hidden
    states, normalised."""
    import torch
    from transformers import AutoModel

    from server.test_serve_cli import start
    proc, base = start(tiny_model_dir, "--runner", "pooling", "--pooler-config",
                       '{"pooling_type": "MEAN", "normalize": true}')
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        model = c.models.list().data[0].id
        ids = [[5, 17, 40, 99], [300, 7]]
        r = c.embeddings.create(model=model, input=ids)
        hf = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        for d, x in zip(r.data, ids):
            with torch.no_grad():
                h = hf(input_ids=torch.tensor([x])).last_hidden_state[0].mean(0)
            np.testing.assert_allclose(d.embedding, torch.nn.functional.normalize(h, dim=-1),
                                       rtol=1e-4, atol=2e-5)
        assert r.usage.prompt_tokens == 6
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in proc.stdout.read()
