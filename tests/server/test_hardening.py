"""Hardening: one test per defect an outside test found, each failing without its fix, plus
the "must hold" items that are not a defect of
their own (server faults are 500 + a usable connection, the consistency check)."""

from __future__ import annotations

import http.client
import json
import threading
import time

import httpx
import pytest

from iterserve.errors import (ChatTemplateError, ClientError, KVCacheError, ModelLoadError,
                              ServerError)


try:
    from iterserve.server.app import DEFAULT_MAX_REQUEST_BODY_BYTES
except ImportError:            # so that this file also runs on a tree without that constant
    DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20

OK_MESSAGES = [{"role": "user", "content": "Hi"}]


def keepalive(server) -> http.client.HTTPConnection:
    host, port = server.base_url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=60)


def post_raw(conn: http.client.HTTPConnection, path: str, body: bytes
             ) -> tuple[int, dict, dict]:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    return r.status, dict(r.getheaders()), json.loads(data) if data else {}


# --- 1. a lone surrogate: 400, and the keep-alive connection keeps working ---------------------

@pytest.mark.parametrize("path, body", [
    ("/v1/completions", rb'{"prompt": "\udcff", "max_tokens": 2}'),
    ("/v1/chat/completions",
     rb'{"messages": [{"role": "user", "content": "a\udcffb"}], "max_tokens": 2}'),
    ("/v1/completions", rb'{"prompt": "x", "stop": ["\ud800"], "max_tokens": 2}'),
])
def test_lone_surrogate_is_a_400_and_the_connection_stays_usable(server, path, body):
    conn = keepalive(server)
    status, headers, err = post_raw(conn, path, body)
    assert status == 400, err
    assert "surrogate" in err["error"]["message"] and err["error"]["param"]
    sock = conn.sock
    assert sock is not None and headers.get("connection", "").lower() != "close"
    status, _, ok = post_raw(conn, "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
    assert status == 200 and ok["choices"]
    assert conn.sock is sock            # the same connection served the next request
    conn.close()


def test_a_server_fault_is_a_500_with_an_error_body_on_a_usable_connection(start_server):
    s = start_server()

    async def broken(*a, **kw):
        raise RuntimeError("simulated bug")

    s.engine.render_chat = broken          # a fault inside the server, not the client's
    conn = keepalive(s)
    status, _, err = post_raw(conn, "/v1/chat/completions",
                              json.dumps({"messages": OK_MESSAGES, "max_tokens": 2}).encode())
    assert status == 500 and err["error"]["type"] == "internal_error"
    assert "simulated bug" in err["error"]["message"]
    sock = conn.sock
    status, _, ok = post_raw(conn, "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
    assert status == 200 and conn.sock is sock
    conn.close()


def test_model_side_errors_are_typed_by_whose_fault_they_are():
    assert issubclass(ChatTemplateError, ClientError)
    assert issubclass(ModelLoadError, ServerError) and not issubclass(ModelLoadError,
                                                                      ClientError)
    assert issubclass(KVCacheError, ServerError) and not issubclass(KVCacheError, ValueError)
    assert not issubclass(ClientError, ServerError) and not issubclass(ServerError, ClientError)


# --- 2. a body-size limit (413), and tokenising off the event loop -------------------------------

def test_a_body_over_the_limit_is_a_413_with_an_error_body(start_server):
    s = start_server(max_request_body_bytes=64 * 1024)
    conn = keepalive(s)
    body = json.dumps({"prompt": "x" * 100_000, "max_tokens": 1}).encode()
    status, _, err = post_raw(conn, "/v1/completions", body)
    assert status == 413 and "64" in err["error"]["message"] or "65536" in err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"
    status, _, ok = post_raw(conn, "/v1/completions", b'{"prompt": "Hi", "max_tokens": 1}')
    assert status == 200                        # the same connection still works
    # a chunked body (no Content-Length) is counted too
    r = httpx.post(s.v1 + "/completions", content=iter([b'{"prompt": "', b"x" * 70_000, b'"}']),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["message"]


def _health_latencies_during(server, body: bytes, path: str = "/v1/completions"
                            ) -> tuple[list[float], dict]:
    result: dict = {}

    def big():
        t0 = time.monotonic()
        r = httpx.post(server.base_url + path, content=body, timeout=120,
                       headers={"content-type": "application/json"})
        result["status"], result["body"] = r.status_code, r.json()
        result["seconds"] = time.monotonic() - t0

    latencies = []
    with httpx.Client(base_url=server.base_url, timeout=10) as c:
        c.get("/health")                        # connection set up before the clock starts
        t = threading.Thread(target=big)
        t.start()
        while t.is_alive():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.005)
        t.join()
    return latencies, result


def test_health_answers_fast_while_a_prompt_at_the_size_limit_is_handled(server):
    # a prompt filling the default body limit: refused as too long (it was 29 s of frozen
    # /health before), without tokenising a text that cannot fit
    words = "hello world, the quick brown fox jumps over it. "
    prompt = (words * (DEFAULT_MAX_REQUEST_BODY_BYTES // len(words)))[
        :DEFAULT_MAX_REQUEST_BODY_BYTES - 100]
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    assert len(body) <= DEFAULT_MAX_REQUEST_BODY_BYTES
    latencies, result = _health_latencies_during(server, body)
    assert result["status"] == 400 and result["body"]["error"]["param"] == "prompt"
    assert result["seconds"] < 5, result["seconds"]
    assert not latencies or max(latencies) < 0.1, sorted(latencies)[-5:]


def test_health_answers_fast_while_the_longest_tokenisable_prompt_tokenises(start_server):
    s = start_server(max_model_len=1024)
    bound = s.engine.max_text_chars()
    prompt = ("The quick brown fox jumps over the lazy dog; " * (bound // 40))[:bound]
    body = json.dumps({"prompt": prompt}).encode()
    with httpx.Client(base_url=s.base_url) as c:          # tokenised, not refused unread
        r = c.post("/tokenize", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["count"] > 1024
    latencies, result = _health_latencies_during(s, json.dumps(
        {"prompt": prompt, "max_tokens": 1}).encode())
    assert result["status"] == 400 and "tokens" in result["body"]["error"]["message"]
    assert not latencies or max(latencies) < 0.1, sorted(latencies)[-5:]
    too_long = json.dumps({"prompt": prompt + "x"}).encode()
    r = httpx.post(s.base_url + "/tokenize", content=too_long,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]


def test_tokenising_releases_the_gil(server):
    """The fast path lets other threads (the event loop) run while it tokenises."""
    e = server.engine
    text = "hello world, the quick brown fox. " * 20_000           # 680 KB, no length limit
    e._max_token_chars = 10**9                                     # lift the bound for this
    try:
        ticks, stop = [], threading.Event()

        def ticker():
            while not stop.is_set():
                t0 = time.perf_counter()
                time.sleep(0.002)
                ticks.append(time.perf_counter() - t0)

        th = threading.Thread(target=ticker)
        th.start()
        t0 = time.perf_counter()
        ids = e._encode(text, True, None)
        took = time.perf_counter() - t0
        stop.set()
        th.join()
    finally:
        e._max_token_chars = None
    assert len(ids) > 100_000
    assert len(ticks) >= 5 and took > 0.1, (took, len(ticks))
    assert max(ticks) < max(0.1, took / 3), (max(ticks), took)


def test_the_fast_tokenizer_path_agrees_with_tokenizer_encode(server):
    import asyncio

    e = server.engine
    for text in ["Hello world", " leading space", "日本語 and émoji 🙂", "a\nb\n\n"]:
        for special in (True, False):
            assert e._encode(text, special, None) == e.tokenizer.encode(
                text, add_special_tokens=special)
    assert asyncio.run(e.tokenize("Hi", add_special_tokens=True)) == e.tokenizer.encode("Hi")


# --- 3. n is bounded (OpenAI's 128) ----------------------------------------------------------------

def test_n_above_128_is_a_400_and_128_is_served(server):
    r = httpx.post(server.v1 + "/completions", timeout=120,
                   json={"prompt": "Hi", "max_tokens": 1, "n": 129})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(server.v1 + "/completions", timeout=120,
                   json={"prompt": "Hi", "max_tokens": 1, "n": 128})
    assert r.status_code == 200 and len(r.json()["choices"]) == 128


# --- 4. NaN / +-inf in every float field -----------------------------------------------------------

FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_nan_and_infinity_are_refused_in_every_float_field(server, path, field, value):
    base = '"prompt": "x"' if path == "/v1/completions" else \
        '"messages": [{"role": "user", "content": "x"}]'
    body = f'{{{base}, "max_tokens": 1, "{field}": {value}}}'.encode()
    r = httpx.post(server.base_url + path, content=body, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


# --- 5. the API key covers every route but /health, /ping and the static lab page -------------------

def test_api_key_covers_every_route_and_401s_say_bearer(start_server):
    s = start_server(api_key="sekret")
    closed = [("POST", "/v1/lab/run", {}), ("GET", "/v1/engine/stats", None),
              ("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x"}),
              ("GET", "/openapi.json", None), ("POST", "/tokenize", {"prompt": "x"}),
              ("GET", "/version", None), ("GET", "/v1/requests/x/trace", None)]
    for method, path, body in closed:
        r = httpx.request(method, s.base_url + path, json=body, timeout=30)
        assert r.status_code == 401, (path, r.status_code)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
        good = httpx.request(method, s.base_url + path, json=body, timeout=30,
                             headers={"Authorization": "Bearer sekret"})
        assert good.status_code != 401, path
    for path in ["/health", "/ping", "/lab", "/lab/static/lab.js", "/metrics"]:
        assert httpx.get(s.base_url + path, timeout=30).status_code == 200, path


def test_metrics_require_auth(start_server):
    s = start_server(api_key="sekret", metrics_require_auth=True)
    r = httpx.get(s.base_url + "/metrics")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(s.base_url + "/metrics", headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200 and "iterserve:" in r.text


# --- 7. /openapi.json says 400 and states every limit, and a request at the limits is served --------

def test_openapi_says_400_and_states_the_limits(server):
    spec = httpx.get(server.base_url + "/openapi.json").json()
    text = json.dumps(spec)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]:
        assert "400" in spec["paths"][path]["post"]["responses"], path
        assert "413" in spec["paths"][path]["post"]["responses"], path
    schemas = spec["components"]["schemas"]
    cmpl, chat = schemas["CompletionRequest"]["properties"], \
        schemas["ChatCompletionRequest"]["properties"]

    def bound(prop, key):
        for b in prop.get("anyOf", [prop]):
            if key in b:
                return b[key]
        raise AssertionError((prop, key))

    max_model_len = server.engine.max_model_len
    assert bound(cmpl["max_tokens"], "maximum") == max_model_len - 1
    assert bound(chat["max_completion_tokens"], "maximum") == max_model_len - 1
    assert bound(cmpl["n"], "maximum") == 128 and bound(cmpl["n"], "minimum") == 1
    assert bound(cmpl["logprobs"], "maximum") == 20
    assert bound(chat["top_logprobs"], "maximum") == 20
    assert bound(cmpl["seed"], "maximum") == pytest.approx(2**63 - 1)     # JSON: a float
    # fcfs schedules no priorities: the schema offers only the neutral value
    assert cmpl["priority"]["enum"] == [0, None]
    stop_list = [b for b in cmpl["stop"]["anyOf"] if b.get("type") == "array"][0]
    assert stop_list["maxItems"] == 16
    assert schemas["CompletionRequest"]["additionalProperties"] is False


def test_a_request_at_the_schema_limits_is_served(server):
    r = httpx.post(server.v1 + "/completions", timeout=120, json={
        "prompt": [1], "max_tokens": server.engine.max_model_len - 1, "n": 2,
        "stop": [f"zz{i}" for i in range(16)], "seed": 2**63 - 1, "logprobs": 20,
        "temperature": 100, "top_k": 2**31 - 1, "top_p": 1, "min_p": 1,
        "repetition_penalty": 100, "presence_penalty": -2, "frequency_penalty": 2,
        "stop_token_ids": [2**31 - 1]})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


# --- 8. a user message without content ----------------------------------------------------------------

@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None},
                                     {"role": "system"}])
def test_a_message_without_content_is_a_400(server, message):
    r = httpx.post(server.v1 + "/chat/completions", timeout=30,
                   json={"messages": [message], "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("messages.0")
    assert "content" in r.json()["error"]["message"]


# --- the production consistency check --------------------------------------------------------------

def _count_checks(engine, problems=()):
    calls = []

    def check_health():
        calls.append(time.monotonic())
        return list(problems)

    engine.engine.check_health = check_health      # an LLMEngine instance attribute
    return calls


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_the_consistency_check_runs_when_the_engine_goes_idle(start_server, caplog):
    s = start_server()
    calls = _count_checks(s.engine, problems=["request r-1: holds a block twice"])
    r = httpx.post(s.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 4,
                                                "ignore_eos": True}, timeout=30)
    assert r.status_code == 200
    assert wait_until(lambda: len(calls) >= 1)
    time.sleep(0.2)
    assert len(calls) == 1                          # once per idle transition, not per step
    assert "holds a block twice" in s.engine.health_violations[0]


def test_the_consistency_check_runs_every_step_under_the_debug_flag(start_server):
    s = start_server(debug_check_consistency=True)
    calls = _count_checks(s.engine)
    r = httpx.post(s.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 6,
                                                "ignore_eos": True}, timeout=30)
    assert r.status_code == 200
    assert wait_until(lambda: len(calls) >= 7)      # >= 6 steps, plus the idle check
