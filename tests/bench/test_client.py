"""The streaming client against a stub OpenAI server: parsing, timing and the JSON shape."""

import asyncio
import json

import pytest

from iterserve.bench.cli import register
from iterserve.bench.client import ClientOptions, run_sweep, run_workload
from iterserve.bench.metrics import SLO
from iterserve.bench.workloads import build_workload
from iterserve.errors import BenchClientError

from .openai_stub import StubConfig, running_stub

SUMMARY_KEYS = {"num_requests", "completed", "failed", "duration_s", "total_input_tokens",
                "total_output_tokens", "request_throughput", "output_throughput",
                "total_token_throughput", "ttft", "itl", "tpot", "e2e", "slo",
                "good_requests", "goodput", "slo_met", "retried", "served_after_retry"}
STAT_KEYS = {"mean_ms", "median_ms", "p90_ms", "p99_ms", "max_ms", "count"}


def small_mix(n=6):
    return build_workload("mix", num_requests=n, seed=3)


def test_every_request_streams_its_max_tokens_and_the_result_has_the_documented_shape():
    w = small_mix()
    cfg = StubConfig()
    with running_stub(cfg) as url:
        doc = asyncio.run(run_workload(url, w))
    s = doc["summary"]
    assert SUMMARY_KEYS <= set(s)
    for k in ("ttft", "itl", "tpot", "e2e"):
        assert STAT_KEYS <= set(s[k])
    assert s["completed"] == s["num_requests"] == 6 and s["failed"] == 0
    assert s["total_output_tokens"] == w.total_output_tokens
    assert doc["model"] == "stub-model"
    for rec, req in zip(doc["requests"], w.requests):
        assert rec["success"] and rec["output_tokens"] == req.max_tokens
        assert rec["chunks"] == req.max_tokens
        assert len(rec["itl"]) == req.max_tokens - 1
        assert 0 < rec["ttft"] <= rec["e2e"]
    # the server saw the OpenAI streaming request with ignore_eos and greedy sampling
    body = cfg.received[0]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    json.dumps(doc)  # JSON-serialisable


def test_without_a_usage_block_tokens_are_counted_from_the_chunks():
    w = small_mix(3)
    with running_stub(StubConfig(send_usage=False)) as url:
        doc = asyncio.run(run_workload(url, w, ClientOptions(endpoint="chat")))
    for rec, req in zip(doc["requests"], w.requests):
        assert rec["output_tokens"] == rec["chunks"] == req.max_tokens
        assert rec["prompt_tokens_reported"] is None


def test_ttft_reflects_the_servers_first_token_delay():
    w = small_mix(2)
    with running_stub(StubConfig(first_token_delay_s=0.2, token_delay_s=0.0)) as url:
        doc = asyncio.run(run_workload(url, w))
    assert doc["summary"]["ttft"]["median_ms"] >= 190
    assert doc["summary"]["itl"]["median_ms"] < 100


def test_a_failing_request_is_recorded_as_failed_not_raised():
    w = small_mix(4)
    victim = w.requests[1].prompt
    with running_stub(StubConfig(fail_prompts_containing=victim)) as url:
        doc = asyncio.run(run_workload(url, w))
    assert doc["summary"]["failed"] == 1 and doc["summary"]["completed"] == 3
    bad = doc["requests"][1]
    assert not bad["success"] and bad["error"].startswith("HTTP 500")
    assert doc["summary"]["slo_met"] is False


def test_poisson_arrivals_are_sent_no_earlier_than_scheduled():
    w = build_workload("poisson", rate=20.0, num_requests=5)
    with running_stub() as url:
        doc = asyncio.run(run_workload(url, w))
    for rec in doc["requests"]:
        assert rec["start_s"] >= rec["scheduled_s"] - 1e-3


def test_an_unreachable_server_is_a_clear_error():
    with pytest.raises(BenchClientError, match="/v1/models"):
        asyncio.run(run_workload("http://127.0.0.1:9", small_mix(1)))


def test_bad_urls_and_options_are_rejected():
    with pytest.raises(BenchClientError, match="http"):
        asyncio.run(run_workload("localhost:8000", small_mix(1)))
    with pytest.raises(BenchClientError, match="endpoint"):
        ClientOptions(endpoint="embeddings").validate()
    with pytest.raises(BenchClientError, match="client"):
        ClientOptions(client="curl").validate()
    with pytest.raises(BenchClientError, match="max_retries"):
        ClientOptions(client="openai", max_retries=-1).validate()


def test_a_sweep_reports_capacity_as_the_highest_rate_meeting_the_slo():
    with running_stub(StubConfig(first_token_delay_s=0.0, token_delay_s=0.0)) as url:
        doc = run_sweep(url, "poisson", [50.0, 100.0], SLO(ttft_s=5.0, itl_s=5.0),
                        num_requests=4)
    assert [r["rate"] for r in doc["runs"]] == [50.0, 100.0]
    assert doc["capacity_rps"] == 100.0
    with pytest.raises(BenchClientError, match="--slo"):
        run_sweep("http://127.0.0.1:9", "poisson", [1.0], SLO())


def test_the_cli_writes_the_json_result(tmp_path, capsys):
    import argparse
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    out = tmp_path / "r.json"
    with running_stub() as url:
        args = parser.parse_args(["bench", "serve", "--base-url", url + "/v1", "--workload",
                                  "mix", "--num-requests", "3", "--slo", "ttft:5000,itl:500",
                                  "--out", str(out)])
        assert args.func(args) == 0
    doc = json.loads(out.read_text())
    assert doc["workload"]["name"] == "mix" and doc["summary"]["completed"] == 3
    assert doc["summary"]["slo"] == {"ttft_ms": 5000.0, "itl_ms": 500.0}
    assert "output tok/s" in capsys.readouterr().out
    args = parser.parse_args(["bench", "serve", "--base-url", "http://x", "--slo", "bogus"])
    assert args.func(args) == 2


def test_sessions_send_each_turn_after_the_last_answered_and_summarise_per_turn():
    import asyncio

    from iterserve.bench.sessions import run_sessions, ttft_over_turns
    from iterserve.bench.workloads import agent

    w = agent(num_requests=3, num_turns=4, system_len=20, tool_len=(5, 8), answer_len=(2, 3))
    cfg = StubConfig(cached_tokens=11)
    with running_stub(cfg) as url:
        doc = asyncio.run(run_sessions(url, w, turns=(2, 4)))
    assert doc["kind"] == "sessions" and doc["turns"] == [2, 4]
    assert doc["summary"]["completed"] == 9 and doc["summary"]["failed"] == 0
    assert sorted(doc["per_turn"]) == ["2", "3", "4"]
    assert all(t["completed"] == 3 and t["cached_tokens"] == 33 for t in doc["per_turn"].values())
    # each session's turns reached the server in order, one at a time
    sent = [b["prompt"] for b in cfg.received]
    for s in range(3):
        mine = [p for p in sent if p in {r.prompt for r in w.requests if r.session == s}]
        assert mine == [r.prompt for r in w.requests if r.session == s and r.turn >= 2]
    assert ttft_over_turns(doc, 2, 4) > 0


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_openai_client_retries_a_429_after_retry_after_and_times_both_attempts(endpoint):
    """Through the official SDK: a request refused once is served by its retry, after the
    server's Retry-After; TTFT counts from the first attempt, `ttft_admitted` from the one
    the server took."""
    w = small_mix(4)
    cfg = StubConfig(refuse_first=1, retry_after_ms=300, first_token_delay_s=0.0)
    opts = ClientOptions(client="openai", max_retries=2, endpoint=endpoint)
    with running_stub(cfg) as url:
        doc = asyncio.run(run_workload(url, w, opts, SLO(ttft_s=0.2)))
    s = doc["summary"]
    assert s["completed"] == 4 and s["retried"] == 4 and s["served_after_retry"] == 4
    assert doc["options"]["client"] == "openai" and doc["options"]["max_retries"] == 2
    for rec, req in zip(doc["requests"], w.requests):
        assert rec["success"] and rec["attempts"] == 2
        assert rec["output_tokens"] == req.max_tokens
        assert rec["ttft"] >= 0.3 > rec["ttft_admitted"] > 0, rec
    assert s["good_requests"] == 0      # the application waited the Retry-After: late
    assert len(cfg.received) == 8 and cfg.received[0]["ignore_eos"] is True


def test_without_retries_the_openai_clients_refusal_is_recorded_as_a_429():
    cfg = StubConfig(refuse_first=1)
    with running_stub(cfg) as url:
        doc = asyncio.run(run_workload(url, small_mix(2),
                                       ClientOptions(client="openai", max_retries=0)))
    assert doc["summary"]["completed"] == 0 and doc["summary"]["retried"] == 0
    assert all(r["error"].startswith("HTTP 429") and r["attempts"] == 1
               for r in doc["requests"])
