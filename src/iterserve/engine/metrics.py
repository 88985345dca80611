"""Per-request latency metrics and per-step statistics, computed from the request's own times.

The scheduler stamps a request (arrival, first scheduled, each token, finished) on one clock;
the numbers users care about are differences of those stamps:

- queue time  = first admitted - arrival
- TTFT        = first token - arrival
- ITL         = gaps between consecutive output tokens
- E2E         = finished - arrival

`StatLogger`s (the server's Prometheus exporter, tests) receive a `StepStats` after every
engine step; they must be cheap and must not raise (a failing logger is logged and dropped
for that step, never allowed to fail the requests).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from iterserve.core.request import Request


@dataclass(slots=True)
class RequestMetrics:
    """Latency numbers of one sequence, in seconds (None while not yet known)."""

    arrival_time: float
    queue_time: float | None = None
    time_to_first_token: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latency: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def mean_inter_token_latency(self) -> float | None:
        itl = self.inter_token_latencies
        return sum(itl) / len(itl) if itl else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mean_inter_token_latency"] = self.mean_inter_token_latency
        return d

    @classmethod
    def from_request(cls, req: Request, now: float | None = None) -> "RequestMetrics":
        """Metrics of `req` so far; `now` stands in for a missing finish stamp."""
        arrival = req.arrival_time
        times = req.token_times
        finished = req.finished_time
        if finished is None and req.is_finished:
            finished = now
        return cls(
            arrival_time=arrival,
            queue_time=(req.first_scheduled_time - arrival
                        if req.first_scheduled_time is not None else None),
            time_to_first_token=(req.first_token_time - arrival
                                 if req.first_token_time is not None else None),
            inter_token_latencies=[b - a for a, b in zip(times, times[1:])],
            e2e_latency=finished - arrival if finished is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions,
        )


def merge_metrics(parts: list[RequestMetrics]) -> RequestMetrics:
    """One request's metrics from its n sequences (n > 1): the first token of any sequence,
    the last finish of all, ITLs pooled, tokens and preemptions summed."""
    if len(parts) == 1:
        return parts[0]

    def first(values: list[float | None], pick=min) -> float | None:
        known = [v for v in values if v is not None]
        return pick(known) if known else None

    done = all(p.e2e_latency is not None for p in parts)
    return RequestMetrics(
        arrival_time=min(p.arrival_time for p in parts),
        queue_time=first([p.queue_time for p in parts]),
        time_to_first_token=first([p.time_to_first_token for p in parts]),
        inter_token_latencies=[x for p in parts for x in p.inter_token_latencies],
        e2e_latency=first([p.e2e_latency for p in parts], max) if done else None,
        num_prompt_tokens=parts[0].num_prompt_tokens,
        num_output_tokens=sum(p.num_output_tokens for p in parts),
        num_cached_tokens=sum(p.num_cached_tokens for p in parts),
        num_preemptions=sum(p.num_preemptions for p in parts),
    )


@dataclass(slots=True)
class StepStats:
    """What happened in one engine step, for stat loggers (counters and histograms)."""

    step: int
    time: float
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    num_batched_tokens: int = 0
    num_prompt_tokens: int = 0          # prompt tokens of requests whose prefill completed
    num_generation_tokens: int = 0      # tokens sampled this step
    num_preemptions: int = 0            # preemptions this step
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[RequestMetrics] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    # speculative decoding: this step's verifications (core/spec_decode SpecDecodingStats)
    spec_decoding: Any = None


class StatLogger(Protocol):
    def log(self, stats: StepStats) -> None: ...


class LoggingStatLogger:
    """vLLM's periodic stats line (`iterserve serve` without --disable-log-stats): every
    `interval` seconds of engine time in which steps ran, one INFO line with the prompt and
    generation throughput over the interval, the running / waiting requests and KV use at
    its end. Only steps feed it, so an idle server writes nothing."""

    def __init__(self, interval: float = 10.0, logger_name: str = "iterserve.stats") -> None:
        import logging

        self.interval = interval
        self.logger = logging.getLogger(logger_name)
        self._start: float | None = None
        self._prompt = 0
        self._generation = 0

    def log(self, stats: StepStats) -> None:
        if self._start is None:
            self._start = stats.time
        self._prompt += stats.num_prompt_tokens
        self._generation += stats.num_generation_tokens
        elapsed = stats.time - self._start
        if elapsed < self.interval:
            return
        self.logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, Swapped: %d reqs, KV cache usage: %.1f%%",
            self._prompt / elapsed, self._generation / elapsed, stats.num_running,
            stats.num_waiting, stats.num_swapped, 100 * stats.kv_cache_usage)
        self._start, self._prompt, self._generation = stats.time, 0, 0
