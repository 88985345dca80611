"""Latency aggregates, SLO parsing and goodput mean what metrics.py documents."""

import pytest

from iterserve.bench.metrics import SLO, RequestRecord, parse_slo, percentile, summarize
from iterserve.errors import SLOError


def rec(i, ttft, gaps, ok=True, prompt_len=10):
    r = RequestRecord(index=i, prompt_len=prompt_len, max_tokens=len(gaps) + 1)
    if ok:
        r.ttft, r.itl = ttft, list(gaps)
        r.e2e = ttft + sum(gaps)
        r.output_tokens = r.chunks = len(gaps) + 1
        r.success = True
    else:
        r.error = "HTTP 500"
    return r


def test_percentile_interpolates_linearly_like_numpy():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([], 50) is None


def test_slo_spec_parses_milliseconds_into_seconds_and_rejects_garbage():
    assert parse_slo("ttft:500,itl:50") == SLO(0.5, 0.05)
    assert parse_slo("itl:20") == SLO(None, 0.02)
    assert parse_slo(None) == SLO()
    for bad in ("ttft", "ttft:abc", "e2e:5", "ttft:-1", "ttft:nan"):
        with pytest.raises(SLOError):
            parse_slo(bad)


def test_throughputs_divide_tokens_by_the_run_duration():
    records = [rec(0, 0.1, [0.01] * 9, prompt_len=5), rec(1, 0.2, [0.02] * 19, prompt_len=15)]
    s = summarize(records, duration_s=2.0)
    assert s["total_output_tokens"] == 30 and s["total_input_tokens"] == 20
    assert s["output_throughput"] == 15.0 and s["total_token_throughput"] == 25.0
    assert s["request_throughput"] == 1.0
    assert s["itl"]["count"] == 28 and s["ttft"]["mean_ms"] == pytest.approx(150.0)


def test_goodput_counts_only_requests_meeting_both_slos():
    records = [rec(0, 0.1, [0.01] * 4),      # good
               rec(1, 0.9, [0.01] * 4),      # TTFT too slow
               rec(2, 0.1, [0.20] * 4),      # TPOT too slow
               rec(3, 0.1, [], ok=False)]    # failed
    s = summarize(records, duration_s=1.0, slo=SLO(ttft_s=0.5, itl_s=0.05))
    assert s["good_requests"] == 1 and s["goodput"] == 1.0
    assert s["failed"] == 1 and s["slo_met"] is False


def test_slo_met_uses_the_p99_of_ttft_and_itl():
    records = [rec(i, 0.1, [0.01] * 10) for i in range(10)]
    assert summarize(records, 1.0, SLO(ttft_s=0.2, itl_s=0.02))["slo_met"] is True
    assert summarize(records, 1.0, SLO(ttft_s=0.05))["slo_met"] is False
    assert summarize(records, 1.0, SLO(itl_s=0.005))["slo_met"] is False


def test_a_non_positive_duration_is_rejected():
    with pytest.raises(ValueError, match="duration"):
        summarize([], 0.0)
