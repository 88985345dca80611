"""No constraint can end the process, stall the engine or end in a 500 (issue 27): over real
HTTP with the official `openai` client, against a tiny random model.

- The outside test's bombs (nested counted repetitions, a 30,000-literal alternation, 20,000
  choices, a 3,500-rule chain) are 400s at admission naming the limit; the server stays
  healthy with every KV block back.
- A constraint that passes admission and overruns the grammar engine mid-generation ends
  as the request's 400 (non-streamed) or as finish_reason "error" + an error event with the
  same code + [DONE] (streamed), never a 500.
- Compiling runs on the compiler's threads, never on the engine thread: a slow compile
  leaves another stream's steps running; the compiler is warm before the first constrained
  request arrives.
"""

from __future__ import annotations

import gc
import json
import threading
import time

import httpx
import openai
import pytest

from iterserve.structured import backend


def _chain(n):
    return "\n".join(["start: r1"] + [f"r{i}: r{i + 1}" for i in range(1, n)] + [f'r{n}: "a"'])


BOMBS = [
    ({"structured_outputs": {"regex": "((a{100}){100}){100}"}}, "MAX_REPEAT_PRODUCT",
     "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "(x{1000}){1000}"}}, "MAX_REPEAT_PRODUCT",
     "structured_outputs.regex"),
    ({"guided_regex": "(x{1000}){1000}"}, "MAX_REPEAT_PRODUCT", "guided_regex"),
    ({"structured_outputs": {"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(30000))}},
     "MAX_CONSTRAINT_BYTES", "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "start: " + " | ".join(f'"{i}"' for i in range(5000))}},
     "MAX_ALTERNATIVES", "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": [f"item{i}" for i in range(20000)]}}, "MAX_CHOICES",
     "structured_outputs.choice"),
    ({"guided_grammar": _chain(3500)}, "MAX_GRAMMAR_RULES", "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}}}}},
     "MAX_PROPERTIES", "response_format.json_schema.schema"),
]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def _free_blocks(server) -> int:
    return httpx.get(server.v1 + "/engine/stats").json()["num_free_blocks"]


@pytest.mark.parametrize("extra,limit,param", BOMBS, ids=[b[1] + "-" + b[2] for b in BOMBS])
def test_constraint_bombs_are_400s_naming_the_limit(client, server, extra, limit, param):
    free = _free_blocks(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="x", max_tokens=4,
                                  extra_body=extra)
    err = e.value.body
    assert limit in err["message"] and err["param"] == param, err
    assert err["code"] == "constraint_too_complex"
    assert len(err["message"]) < 1000
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert _free_blocks(server) == free


def test_guided_choice_and_structured_outputs_choice_have_the_same_cap(server):
    for extra in ({"guided_choice": [f"c{i}" for i in range(1025)]},
                  {"structured_outputs": {"choice": [f"c{i}" for i in range(1025)]}}):
        r = httpx.post(server.v1 + "/completions", timeout=60,
                       json={"prompt": "x", "max_tokens": 2, **extra})
        assert r.status_code == 400, r.text
        assert "1024" in r.text or "1,024" in r.text
    items = [f"c{i}" for i in range(1024)]
    r = httpx.post(server.v1 + "/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 8, "temperature": 0,
        "structured_outputs": {"choice": items}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in items


@pytest.fixture(scope="module")
def overrun_server(start_server):
    """A server whose grammar engine allows 40 Earley items a row (llguidance's default is
    2,000, which a right-recursive rule reaches after ~2,000 tokens): the same failure, 50x
    sooner."""
    saved = dict(backend.PARSER_LIMITS)
    backend.PARSER_LIMITS["max_items_in_row"] = 40
    try:
        s = start_server(max_model_len=256)
        s.engine.engine.structured_compiler     # built now, with the lowered limit
    finally:
        backend.PARSER_LIMITS.clear()
        backend.PARSER_LIMITS.update(saved)
    return s


# Right recursion: each token adds an Earley item to the row; min_tokens holds EOS back, so
# the output grows until the row overruns.
RIGHT_RECURSIVE = 'start: "a" start | "a"'
LEFT_RECURSIVE = 'start: start "a" | "a"'


def test_an_overrun_mid_generation_is_the_requests_400(overrun_server):
    s = overrun_server
    free = _free_blocks(s)
    r = httpx.post(s.v1 + "/completions", timeout=120, json={
        "prompt": "x", "max_tokens": 120, "temperature": 0, "min_tokens": 120,
        "structured_outputs": {"grammar": RIGHT_RECURSIVE}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "constraint_too_complex" and err["type"] == "invalid_request_error"
    assert "structured_outputs.grammar" in err["message"] and "left-recursive" in err["message"]
    # left recursion is the cure, as the message says
    r = httpx.post(s.v1 + "/completions", timeout=120, json={
        "prompt": "x", "max_tokens": 120, "temperature": 0, "min_tokens": 120,
        "structured_outputs": {"grammar": LEFT_RECURSIVE}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and set(choice["text"]) == {"a"}, choice
    _wait_free(s, free)


def test_an_overrun_mid_stream_ends_with_finish_reason_error_and_done(overrun_server):
    s = overrun_server
    with httpx.stream("POST", s.v1 + "/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "a"}], "max_tokens": 120,
            "temperature": 0, "stream": True, "min_tokens": 120,
            "structured_outputs": {"grammar": RIGHT_RECURSIVE}}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    finishes = [c["finish_reason"] for p in parsed for c in p.get("choices", [])
                if c.get("finish_reason")]
    assert finishes == ["error"], finishes
    errors = [p["error"] for p in parsed if "error" in p]
    assert len(errors) == 1 and errors[0]["code"] == "constraint_too_complex", errors


def _wait_free(s, free, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _free_blocks(s) != free:
        time.sleep(0.05)
    assert _free_blocks(s) == free


def test_compiling_never_blocks_the_engine_thread(start_server, monkeypatch):
    """A constraint that takes 3 s to compile: another request's stream keeps getting tokens
    meanwhile, with no gap of half the compile time (a compile on the engine thread makes
    every stream wait all of it), and the compile ran on a compile worker."""
    s = start_server(max_model_len=1024, num_kv_blocks=256)
    threads: list[str] = []
    inner = backend.StructuredOutputCompiler._build

    def slow_build(self, params, key):
        threads.append(threading.current_thread().name)
        if params.kind == "regex" and params.value == "slow[0-9]+":
            time.sleep(3.0)
        return inner(self, params, key)

    monkeypatch.setattr(backend.StructuredOutputCompiler, "_build", slow_build)
    times: list[float] = []
    done = threading.Event()

    def plain_stream():
        with httpx.stream("POST", s.v1 + "/completions", timeout=60, json={
                "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())
                if done.is_set():
                    return          # leaving the stream aborts the request

    # The suite's earlier tests leave a large heap in this process: a full collection of it
    # stops every thread while it runs, which is not the engine waiting on a compile.
    gc.collect()
    gc.freeze()
    t = threading.Thread(target=plain_stream)
    t.start()
    try:
        while len(times) < 3:
            time.sleep(0.01)
        t0 = time.monotonic()
        r = httpx.post(s.v1 + "/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "slow[0-9]+"}})
        t1 = time.monotonic()
    finally:
        done.set()
        t.join()
        gc.unfreeze()
    assert r.status_code == 200, r.text
    assert t1 - t0 >= 3.0
    during = [b - a for a, b in zip(times, times[1:]) if t0 <= a and b <= t1 - 0.1]
    assert len(during) >= 5, (len(during), len(times))
    assert max(during) < 1.5, max(during)
    assert threads and all(n.startswith("grammar-compile") for n in threads), threads


def test_the_compiler_is_warm_before_the_first_constrained_request(start_server):
    s = start_server()
    httpx.post(s.v1 + "/completions", timeout=30, json={"prompt": "x", "max_tokens": 1})
    warm = s.engine._warm_thread
    assert warm is not None
    warm.join(timeout=60)
    compiler = s.engine.engine.input_processor._compiler
    assert compiler is not None and compiler.num_compiled >= 1      # the warm-up's grammar
