"""Schema fuzzing: schemathesis generates requests for every operation of the
server's own /openapi.json, valid ones (positive) and invalid ones (negative), sends them over
real HTTP and checks: no response >= 500, every 4xx carries an OpenAI error body, and the
server is healthy afterwards with every KV block back.

`n` and `max_tokens` are bounded by the schema itself (n <= 128, max_tokens <= max_model_len
- 1); the server under test has max_model_len 64 so the worst valid request (n=128 x 63
tokens) stays cheap. Bounded for CI: examples per operation and mode below, derandomised
(the same cases every run; change FUZZ_SEED locally to explore further), no shrinking.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

POST_EXAMPLES = int(os.environ.get("ITERSERVE_FUZZ_EXAMPLES", "25"))
GET_EXAMPLES = 5


@pytest.fixture(scope="module")
def fuzz_server(start_server):
    return start_server(max_model_len=64, num_kv_blocks=256, max_num_seqs=64)


def _check(case, response, problems: list[str]) -> None:
    where = f"{case.method} {case.path} body={json.dumps(case.body, default=str)[:300]}"
    if response.status_code >= 500:
        problems.append(f"{response.status_code} for {where}: {response.text[:300]}")
    elif 400 <= response.status_code < 500:
        try:
            err = response.json()["error"]
            assert isinstance(err["message"], str) and err["message"]
            assert isinstance(err["type"], str) and err["type"]
        except Exception:
            problems.append(f"{response.status_code} without an OpenAI error body for {where}: "
                            f"{response.text[:300]}")


def test_every_operation_fuzzed_gets_no_5xx_and_openai_error_bodies(fuzz_server):
    s = fuzz_server
    spec = httpx.get(s.base_url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(spec)
    free_before = httpx.get(s.v1 + "/engine/stats").json()["num_free_blocks"]
    problems: list[str] = []
    counts: dict[str, int] = {}
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    for op in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE,
                     schemathesis.GenerationMode.NEGATIVE):
            examples = POST_EXAMPLES if op.method.upper() == "POST" else GET_EXAMPLES

            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case):
                response = case.call(base_url=s.base_url, timeout=120)
                counts[op.label] = counts.get(op.label, 0) + 1
                _check(case, response, problems)

            try:
                fuzz()
            except Unsatisfiable:       # nothing to make invalid (a GET without parameters)
                assert mode == schemathesis.GenerationMode.NEGATIVE, op.label
    print("fuzzed requests per operation:", counts)
    assert not problems, "\n".join(problems[:10])
    assert sum(counts.values()) >= 100, counts
    # healthy after: answers, and every block is back once the engine is idle
    assert httpx.get(s.base_url + "/health").status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = httpx.get(s.v1 + "/engine/stats").json()
        if st["num_running"] == st["num_waiting"] == st["num_swapped"] == 0 and \
                st["num_free_blocks"] == free_before:
            break
        time.sleep(0.05)
    assert st["num_free_blocks"] == free_before, st
    ok = httpx.post(s.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
