"""Per-request latency records and the aggregates every benchmark reports.

Why one module: the online client, the offline benchmark and the peers' scripts all report
through `summarize`, so "output tok/s" or "p99 ITL" means the same thing in every row of
BENCHMARKS.md. Pure Python (no numpy, no torch) so the lab and tests can import it cheaply.

Definitions (times in seconds):
- TTFT: request sent -> first generated token received.
- ITL: each gap between consecutive generated tokens of one request (all gaps of all
  requests are pooled for the percentiles, as vLLM's benchmark does).
- TPOT: per request, (E2E - TTFT) / (output_tokens - 1): the mean gap that request saw.
- E2E: request sent -> last token received.
- duration: first request sent -> last request finished; throughputs divide by it.
- goodput: requests/s of requests that met *both* SLOs (their TTFT <= ttft SLO and their
  TPOT <= itl SLO). `slo_met` is the stricter run-level test used to find capacity in a rate
  sweep: p99 TTFT and p99 ITL over the whole run both under the SLOs, and no failed request.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from iterserve.errors import SLOError



@dataclass(slots=True)
class RequestRecord:
    """What one request experienced, as measured by a client."""

    index: int
    prompt_len: int
    max_tokens: int
    scheduled_s: float = 0.0          # when it was due to be sent (workload arrival)
    start_s: float = 0.0              # when it was sent (benchmark clock)
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0            # counted from the usage block if given, else chunks
    chunks: int = 0                   # stream chunks that carried generated text
    prompt_tokens_reported: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    success: bool = False
    error: str | None = None
    attempts: int = 1                 # sends, with a client that retries a refusal
    ttft_admitted: float | None = None  # from the attempt the server took (retrying client)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float | None = None
    itl_s: float | None = None

    def to_json(self) -> dict:
        return {"ttft_ms": None if self.ttft_s is None else self.ttft_s * 1e3,
                "itl_ms": None if self.itl_s is None else self.itl_s * 1e3}


def parse_slo(spec: str | None) -> SLO:
    """Parse ``ttft:MS,itl:MS`` (either part optional) into seconds."""
    if not spec:
        return SLO()
    values: dict[str, float] = {}
    for part in spec.split(","):
        key, sep, val = part.strip().partition(":")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "itl", "tpot"):
            raise SLOError(f"bad SLO part {part!r}; expected ttft:MS and/or itl:MS")
        try:
            ms = float(val)
        except ValueError:
            raise SLOError(f"SLO {key} needs a number of milliseconds, got {val!r}") from None
        if not (ms > 0 and math.isfinite(ms)):
            raise SLOError(f"SLO {key} must be a positive number of milliseconds, got {val!r}")
        values["itl" if key == "tpot" else key] = ms / 1e3
    return SLO(values.get("ttft"), values.get("itl"))


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_stats(values: list[float]) -> dict:
    """mean/median/p90/p99/max in milliseconds (None when there is nothing to summarise)."""
    if not values:
        return {"mean_ms": None, "median_ms": None, "p90_ms": None, "p99_ms": None,
                "max_ms": None, "count": 0}
    ms = lambda x: None if x is None else round(x * 1e3, 3)  # noqa: E731
    return {"mean_ms": ms(sum(values) / len(values)), "median_ms": ms(percentile(values, 50)),
            "p90_ms": ms(percentile(values, 90)), "p99_ms": ms(percentile(values, 99)),
            "max_ms": ms(max(values)), "count": len(values)}


def _meets(r: RequestRecord, slo: SLO) -> bool:
    if not r.success:
        return False
    if slo.ttft_s is not None and (r.ttft is None or r.ttft > slo.ttft_s):
        return False
    tpot = r.tpot
    if slo.itl_s is not None and tpot is not None and tpot > slo.itl_s:
        return False
    return True


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO = SLO()) -> dict:
    """The aggregate block of a result file."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [g for r in ok for g in r.itl]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    good = sum(1 for r in records if _meets(r, slo))
    ttft_p99, itl_p99 = percentile(ttfts, 99), percentile(itls, 99)
    slo_met = (len(ok) == len(records) and len(ok) > 0
               and (slo.ttft_s is None or (ttft_p99 is not None and ttft_p99 <= slo.ttft_s))
               and (slo.itl_s is None or itl_p99 is None or itl_p99 <= slo.itl_s))
    return {
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "duration_s": round(duration_s, 4),
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": round(len(ok) / duration_s, 4),
        "output_throughput": round(out_tok / duration_s, 3),
        "total_token_throughput": round((in_tok + out_tok) / duration_s, 3),
        "ttft": latency_stats(ttfts), "itl": latency_stats(itls),
        "tpot": latency_stats(tpots), "e2e": latency_stats(e2es),
        "slo": slo.to_json(), "good_requests": good,
        "goodput": round(good / duration_s, 4), "slo_met": slo_met,
        "retried": sum(1 for r in records if r.attempts > 1),
        "served_after_retry": sum(1 for r in ok if r.attempts > 1),
    }
