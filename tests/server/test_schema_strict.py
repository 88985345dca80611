"""The published schema holds both ways, checked by schemathesis' own checks (not only "no
5xx"): every operation, positive and negative cases, and each response is validated for
status codes the schema lists, its content type and headers, its body against the response
schema, and a schema-invalid body refused (negative_data_rejection). test_schema_fuzz.py goes wider (more cases, the KV
books); this one is the strict, fast pass for CI: a few derandomised cases per operation,
the whole run bounded by TIME_BUDGET_S (the test fails if it takes longer, rather than
silently covering less).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import checks as st_checks  # noqa: E402

POST_EXAMPLES = 6
GET_EXAMPLES = 2
TIME_BUDGET_S = 90.0      # ~30 s on an idle 2-core machine; headroom for a loaded one
CHECKS = [st_checks.not_a_server_error, st_checks.status_code_conformance,
          st_checks.content_type_conformance, st_checks.response_headers_conformance,
          st_checks.response_schema_conformance, st_checks.negative_data_rejection]
# Not positive_data_acceptance: what a prompt costs in tokens (against max_model_len) and how
# fields depend on each other (one constraint of several, a named tool that must be in
# `tools`) are checked after the schema, and JSON Schema cannot say them (openapi.py).


@pytest.fixture(scope="module")
def strict_server(start_server):
    return start_server(max_model_len=32, num_kv_blocks=256, max_num_seqs=32)


def test_every_operation_passes_all_schemathesis_checks(strict_server):
    s = strict_server
    spec = httpx.get(s.base_url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(spec)
    failures: list[str] = []
    counts: dict[str, int] = {}
    t0 = time.monotonic()
    operations = [r.ok() for r in schema.get_all_operations()]
    for op in operations:
        if op.path.startswith("/v1/lab"):
            continue        # the lab's simulations: bounded by their own tests, slow here
        for mode in (schemathesis.GenerationMode.POSITIVE,
                     schemathesis.GenerationMode.NEGATIVE):
            examples = POST_EXAMPLES if op.method.upper() == "POST" else GET_EXAMPLES

            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def strict(case):
                response = case.call(base_url=s.base_url, timeout=60)
                counts[op.label] = counts.get(op.label, 0) + 1
                try:
                    case.validate_response(response, checks=CHECKS)
                except (Exception, BaseExceptionGroup) as e:   # noqa: BLE001 - all reported
                    body = json.dumps(case.body, default=str)[:200] \
                        if not isinstance(case.body, type(None)) else ""
                    failures.append(f"{op.label} [{mode.value}] {response.status_code} "
                                    f"body={body}: {str(e)[:400]}")

            try:
                strict()
            except Unsatisfiable:
                assert mode == schemathesis.GenerationMode.NEGATIVE, op.label
    elapsed = time.monotonic() - t0
    print(f"strict schemathesis: {sum(counts.values())} cases in {elapsed:.1f} s: {counts}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:12])
    assert len(counts) >= 10, counts
    assert elapsed <= TIME_BUDGET_S, f"took {elapsed:.1f} s (budget {TIME_BUDGET_S} s)"
