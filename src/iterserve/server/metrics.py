"""Prometheus metrics with vLLM's names under the `iterserve:` prefix.

Each app gets its own CollectorRegistry (tests start several apps in one process, and the
global registry would refuse duplicate names). Counters and histograms are fed by the
engine after every step (`PrometheusStatLogger.log`, on the engine thread; prometheus-client
is thread-safe); the gauges are set from a fresh scheduler snapshot at scrape time, so
`/metrics` read right after an abort already shows the freed blocks.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

from iterserve.engine.metrics import StepStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class PrometheusStatLogger:
    """Owns the metric objects of one app; `log(StepStats)` is the engine's hook."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 extra_labels: dict[str, str] | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        # Replicas (replicas/pool.py): one logger per replica with extra_labels={"replica":
        # id}; its registry goes into the server logger's extra_registries, whose samples
        # render() merges into the same metric families as the server's own (the sums).
        self.extra_registries: list[CollectorRegistry] = []
        extra = dict(extra_labels or {})
        labels = ["model_name", *extra]
        values = [model_name, *extra.values()]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"iterserve:{name}", doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"iterserve:{name}", doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"iterserve:{name}", doc, labels, buckets=buckets,
                             registry=r).labels(*values)

        self.num_requests_running = gauge("num_requests_running",
                                          "Requests holding KV blocks (scheduled each step).")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests queued (never admitted or preempted).")
        self.num_requests_swapped = gauge("num_requests_swapped",
                                          "Requests whose KV blocks are swapped to the host.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc",
                                         "Fraction of device KV blocks in use (0..1).")
        self.num_free_blocks = gauge("num_free_kv_blocks", "Free device KV blocks.")
        self.num_preemptions = counter("num_preemptions", "Preemptions (recompute or swap).")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first admission.", _LATENCY_BUCKETS)
        # The slo policy's admission (refreshed when /metrics is read): how far its TTFT
        # forecasts were from the actual TTFTs, and how many requests it refused.
        self._forecast_error = Gauge(
            "iterserve:slo_ttft_forecast_error_seconds",
            "Actual minus forecast TTFT of the last admitted requests (slo policy), by quantile.",
            ["model_name", *extra, "quantile"], registry=r)
        self.slo_forecast_factor = gauge(
            "slo_ttft_forecast_factor", "Scale the slo policy applies to its TTFT forecasts "
            "(a high quantile of recent actual / forecast).")
        self.slo_refused = gauge("slo_requests_refused",
                                 "Requests the slo policy refused (429) since start.")
        # The compute team (model/contention.py ThreadAdapter), refreshed when /metrics is
        # read: on a shared machine the team shrinks, and an operator needs to see why the
        # steps slowed. Made on first use, so an executor without a team (simulated, remote)
        # shows no series rather than a team of 0.
        self._gauge = gauge
        self._threads: tuple[Any, Any, Any] | None = None
        self._success = Counter("iterserve:request_success", "Finished requests by reason.",
                                ["model_name", *extra, "finished_reason"], registry=r)
        # Speculative decoding (vLLM's names; zero while it is off).
        self.spec_num_drafts = counter("spec_decode_num_drafts",
                                       "Verifications of speculative drafts.")
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                             "Draft tokens verified.")
        self.spec_num_accepted = counter("spec_decode_num_accepted_tokens",
                                         "Draft tokens accepted.")
        self._spec_per_pos = Counter(
            "iterserve:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 first).",
            ["model_name", *extra, "position"], registry=r)
        self._model_name = model_name
        self._extra_values = list(extra.values())

    def log(self, stats: StepStats) -> None:
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for v in stats.time_to_first_tokens:
            self.ttft.observe(v)
        for v in stats.inter_token_latencies:
            self.itl.observe(v)
        for m in stats.finished:
            if m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)
            if m.queue_time is not None:
                self.queue_time.observe(m.queue_time)
        for reason in stats.finish_reasons:
            self._success.labels(self._model_name, *self._extra_values, reason).inc()
        spec = stats.spec_decoding
        if spec is not None and spec.num_drafts:
            self.spec_num_drafts.inc(spec.num_drafts)
            self.spec_num_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_num_accepted.inc(spec.num_accepted_tokens)
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                if n:
                    self._spec_per_pos.labels(self._model_name, *self._extra_values,
                                              str(pos)).inc(n)
        self.set_gauges(num_running=stats.num_running, num_waiting=stats.num_waiting,
                        num_swapped=stats.num_swapped, kv_cache_usage=stats.kv_cache_usage)

    def set_gauges(self, *, num_running: int, num_waiting: int, num_swapped: int,
                   kv_cache_usage: float, num_free_blocks: int | None = None) -> None:
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.num_requests_swapped.set(num_swapped)
        self.kv_cache_usage_perc.set(kv_cache_usage)
        if num_free_blocks is not None:
            self.num_free_blocks.set(num_free_blocks)

    def for_replica(self, model_name: str, replica: str) -> "PrometheusStatLogger":
        """A logger of one replica's own series (label replica=<id>), rendered with this
        one's: the ReplicaPool's stat-logger factory (see `add_stat_logger`)."""
        child = PrometheusStatLogger(model_name, extra_labels={"replica": replica})
        self.extra_registries.append(child.registry)
        return child

    def set_slo(self, slo: dict) -> None:
        """From the engine's stats()["slo"] (core/slo_policy.py `SloPolicy.stats`)."""
        fc = slo.get("ttft_forecast") or {}
        for q in ("p50", "p90", "p99"):
            v = fc.get(f"error_{q}_s")
            if v is not None:
                self._forecast_error.labels(self._model_name, *self._extra_values,
                                            str(int(q[1:]) / 100)).set(v)
        if fc.get("factor") is not None:
            self.slo_forecast_factor.set(fc["factor"])
        self.slo_refused.set(slo.get("refused", 0))

    def set_threads(self, adapter: Any) -> None:
        """From the runner's ThreadAdapter (its plain attributes: safe to read from any thread)."""
        if self._threads is None:
            self._threads = (
                self._gauge("compute_threads", "Threads the last model step ran (the "
                            "contention adapter's choice, or --threads)."),
                self._gauge("cpu_contended", "1 while the contention adapter sees other work "
                            "taking this process's CPUs (steal time, runnable tasks beyond "
                            "its own), else 0."),
                self._gauge("compute_thread_switches",
                            "Changes of the compute team size since start."))
        threads, contended, switches = self._threads
        threads.set(adapter.last_ran)
        contended.set(1 if adapter.busy else 0)
        switches.set(adapter.switches)

    def render(self) -> bytes:
        if not self.extra_registries:
            return generate_latest(self.registry)
        return generate_latest(_MergedFamilies([self.registry, *self.extra_registries]))


class _MergedFamilies:
    """Several registries as one: samples of same-named families go into one family (one
    HELP/TYPE header), as the exposition format requires."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Any:
        merged: dict[str, Any] = {}
        for reg in self.registries:
            for fam in reg.collect():
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        return list(merged.values())
