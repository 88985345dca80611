"""Bad input never crashes or hangs the server: a 4xx with an OpenAI-style error body, and
the server keeps serving afterwards."""

from __future__ import annotations

import httpx
import pytest

from iterserve.server.app import create_app

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "Hi"}]

CASES = [
    # (id, path, raw body or JSON object, expected status, expected param or None)
    ("invalid-json", COMPLETIONS, b'{"prompt": "x",', 400, None),
    ("body-is-a-list", COMPLETIONS, b'[1, 2, 3]', 400, None),
    ("body-is-a-string", CHAT, b'"hello"', 400, None),
    ("empty-body", COMPLETIONS, b"", 400, None),
    ("missing-prompt", COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    ("missing-messages", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("prompt-wrong-type", COMPLETIONS, {"prompt": 12}, 400, None),
    ("max-tokens-wrong-type", COMPLETIONS, {"prompt": "x", "max_tokens": "3"}, 400,
     "max_tokens"),
    ("temperature-wrong-type", COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400,
     "temperature"),
    ("stream-wrong-type", COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, None),
    ("stop-wrong-type", COMPLETIONS, {"prompt": "x", "stop": 5}, 400, None),
    ("priority-wrong-type", COMPLETIONS, {"prompt": "x", "priority": "high"}, 400, "priority"),
    ("messages-not-a-list", CHAT, {"messages": "hi"}, 400, "messages"),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages"),
    ("message-bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("message-no-role", CHAT, {"messages": [{"content": "x"}]}, 400, None),
    ("message-content-wrong-type", CHAT, {"messages": [{"role": "user", "content": 7}]}, 400,
     None),
    ("max-tokens-zero", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", CHAT, {"messages": OK_MESSAGES, "max_tokens": -5}, 400,
     "max_tokens"),
    ("max-tokens-beyond-max-model-len", COMPLETIONS, {"prompt": "x", "max_tokens": 100000}, 400,
     "max_tokens"),
    ("temperature-negative", COMPLETIONS, {"prompt": "x", "temperature": -0.5}, 400,
     "temperature"),
    ("top-p-zero", COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", CHAT, {"messages": OK_MESSAGES, "top_p": 1.5}, 400, "top_p"),
    ("n-zero", COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n"),
    ("logprobs-negative", COMPLETIONS, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("top-logprobs-negative", CHAT, {"messages": OK_MESSAGES, "logprobs": True,
                                     "top_logprobs": -2}, 400, "top_logprobs"),
    ("logprobs-too-many", COMPLETIONS, {"prompt": "x", "logprobs": 1000}, 400, "logprobs"),
    ("token-id-outside-vocab", COMPLETIONS, {"prompt": [1, 2, 999999]}, 400, "prompt"),
    ("token-id-negative", COMPLETIONS, {"prompt": [[1, -4]]}, 400, "prompt"),
    ("empty-prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("empty-token-list", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("prompt-longer-than-max-model-len", COMPLETIONS, {"prompt": [5] * 300}, 400, "prompt"),
    ("chat-longer-than-max-model-len", CHAT,
     {"messages": [{"role": "user", "content": "hello " * 400}]}, 400, "prompt"),
    ("empty-stop-string", COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("unknown-model", COMPLETIONS, {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("unknown-model-chat", CHAT, {"messages": OK_MESSAGES, "model": "gpt-17"}, 404, "model"),
]


@pytest.mark.parametrize("path, body, status, param",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_its_status_and_an_error_body(server, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.base_url + path, headers={"content-type": "application/json"},
                   timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param or (err["param"] or "").startswith(param), err


def test_streaming_request_with_bad_input_fails_before_the_stream(server):
    r = httpx.post(server.base_url + COMPLETIONS, json={"prompt": "x", "max_tokens": 0,
                                                        "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")


def test_unknown_and_unimplemented_fields_are_refused_by_name(server):
    # no field is silently ignored (a 200): unknown and unimplemented ones are both a 400
    r = httpx.post(server.base_url + COMPLETIONS, timeout=30, json={
        "prompt": "x", "max_tokens": 1, "some_future_field": [1]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == \
        "Unrecognized request argument supplied: some_future_field"
    assert r.json()["error"]["param"] == "some_future_field"
    r = httpx.post(server.base_url + COMPLETIONS, timeout=30, json={
        "prompt": "x", "max_tokens": 1, "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search", r.text


def test_unknown_route_and_method_get_error_bodies(server):
    r = httpx.get(server.base_url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.base_url + COMPLETIONS)
    assert r.status_code == 405 and "error" in r.json()


def test_server_keeps_serving_after_every_bad_input(server):
    for _, path, body, _, _ in CASES:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        httpx.post(server.base_url + path, headers={"content-type": "application/json"},
                   timeout=30, **kw)
    r = httpx.post(server.base_url + CHAT, timeout=30,
                   json={"messages": OK_MESSAGES, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    assert not server.engine.engine.has_unfinished_requests()


def test_an_app_without_a_model_answers_503_with_an_error_body():
    from fastapi.testclient import TestClient

    with TestClient(create_app(None)) as c:
        r = c.post(COMPLETIONS, json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert c.post(CHAT, json={"messages": OK_MESSAGES}).status_code == 503
        assert c.get("/v1/engine/stats").status_code == 503
        assert c.get("/v1/requests/x/trace").status_code == 404
        assert c.get("/v1/models").json()["data"] == []
        assert c.get("/health").status_code == 200
        assert c.get("/lab").status_code == 200          # the lab page is always mounted
