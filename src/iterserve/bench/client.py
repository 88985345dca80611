"""An asyncio client that benchmarks any OpenAI-compatible streaming server.

Why the OpenAI streaming API: iterserve, llama.cpp's ``llama-server`` and vLLM all speak it,
so one client measures all of them the same way, from the outside, the way a user would.
Each request is sent at its workload arrival time (open loop: a slow server does not slow
the arrivals down), streamed with ``stream_options.include_usage`` and the ``ignore_eos``
extension (all three servers honour it), and timed on the client's monotonic clock:
TTFT at the first chunk carrying text, one inter-token gap per further text chunk, E2E when
the stream ends. Output tokens come from the usage block when the server sends one,
otherwise from the number of text chunks (these servers stream one token per chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass

import httpx


from .metrics import SLO, RequestRecord, summarize
from .workloads import BenchRequest, Workload, build_workload

from iterserve.errors import BenchClientError


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
CLIENTS = ("httpx", "openai")
# Sent with every request by the openai client so the request hook can tell which benchmark
# request an attempt belongs to (the SDK retries inside one call).
ATTEMPT_HEADER = "x-bench-request"


@dataclass(slots=True)
class ClientOptions:
    endpoint: str = "completions"        # "completions" (exact prompt tokens) or "chat"
    model: str | None = None             # None: ask the server's /v1/models
    max_concurrency: int | None = None   # None: open loop, every request sent on arrival
    request_timeout_s: float = 600.0     # a request taking longer is recorded as failed
    temperature: float = 0.0
    ignore_eos: bool = True
    # "httpx": the client below, which records a refusal as it came. "openai": the official
    # SDK with `max_retries`, which sleeps for the server's Retry-After and sends again, as
    # an application built on it behaves when a server refuses with 429.
    client: str = "httpx"
    max_retries: int = 2

    def validate(self) -> "ClientOptions":
        if self.endpoint not in ENDPOINTS:
            raise BenchClientError(
                f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.client not in CLIENTS:
            raise BenchClientError(
                f"client must be one of {', '.join(CLIENTS)}, got {self.client!r}")
        if self.max_retries < 0:
            raise BenchClientError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.client == "openai":
            try:
                import openai  # noqa: F401
            except ImportError:
                raise BenchClientError(
                    "--client openai needs the openai package (pip install openai)") from None
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchClientError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise BenchClientError("request_timeout_s must be positive")
        return self


def machine_info() -> dict:
    """Where a figure came from: absolute numbers are only meaningful with this."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]   # a loaded machine explains noise
    except OSError:
        load = None
    return {"cpu": cpu, "cpus_usable": usable, "platform": platform.platform(),
            "python": platform.python_version(), "loadavg": load}


def _normalise_base_url(base_url: str) -> str:
    if not base_url.startswith(("http://", "https://")):
        raise BenchClientError(f"base URL must start with http:// or https://, got {base_url!r}")
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _payload(req: BenchRequest, model: str, opts: ClientOptions) -> dict:
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": opts.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


async def stream_one(client: httpx.AsyncClient, url: str, req: BenchRequest, model: str,
                     opts: ClientOptions, t0: float) -> RequestRecord:
    """Send one streaming request and time it. Never raises for server-side problems: the
    record says `success=False` and why."""
    rec = RequestRecord(index=req.index, prompt_len=req.prompt_len, max_tokens=req.max_tokens,
                        scheduled_s=req.arrival_s)
    start = time.perf_counter()
    rec.start_s = start - t0
    last: float | None = None
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", url, json=_payload(req, model, opts)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:500]
                rec.error = f"HTTP {resp.status_code}: {body}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    rec.error = f"unparseable stream chunk: {data[:200]!r}"
                    return rec
                if "error" in chunk:
                    rec.error = f"server error in stream: {str(chunk['error'])[:300]}"
                    return rec
                now = time.perf_counter()
                if any(_chunk_text(c) for c in chunk.get("choices") or ()):
                    last = _text_chunk(rec, now, start, last)
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    rec.prompt_tokens_reported = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = details["cached_tokens"]
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    return _finish(rec, start, usage_tokens)


def _text_chunk(rec: RequestRecord, now: float, start: float, last: float | None) -> float:
    """Time a chunk that carried text: TTFT for the first, an inter-token gap after."""
    if last is None:
        rec.ttft = now - start
    else:
        rec.itl.append(now - last)
    rec.chunks += 1
    return now


def _finish(rec: RequestRecord, start: float, usage_tokens: int | None) -> RequestRecord:
    """A stream that ended without an error: E2E, output tokens, success."""
    rec.e2e = time.perf_counter() - start
    rec.output_tokens = usage_tokens if usage_tokens is not None else rec.chunks
    if rec.chunks == 0:
        rec.error = "stream ended without any generated text"
        return rec
    rec.success = True
    return rec


async def stream_one_openai(client, req: BenchRequest, model: str, opts: ClientOptions,
                            t0: float, sends: dict[int, list[float]]) -> RequestRecord:
    """`stream_one` through the official openai SDK, retries included. TTFT runs from the
    first attempt (what the application waited); `ttft_admitted` from the attempt the server
    took, which is the one an admission promise is about."""
    import openai

    rec = RequestRecord(index=req.index, prompt_len=req.prompt_len, max_tokens=req.max_tokens,
                        scheduled_s=req.arrival_s)
    start = time.perf_counter()
    rec.start_s = start - t0
    last: float | None = None
    usage_tokens: int | None = None
    kw = {"model": model, "max_tokens": req.max_tokens, "temperature": opts.temperature,
          "stream": True, "stream_options": {"include_usage": True},
          "extra_headers": {ATTEMPT_HEADER: str(req.index)}}
    if opts.ignore_eos:
        kw["extra_body"] = {"ignore_eos": True}
    try:
        if opts.endpoint == "chat":
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": req.prompt}], **kw)
        else:
            stream = await client.completions.create(prompt=req.prompt, **kw)
        async for chunk in stream:
            now = time.perf_counter()
            texts = [c.text if opts.endpoint == "completions" else (c.delta.content or "")
                     for c in chunk.choices or ()]
            if any(texts):
                last = _text_chunk(rec, now, start, last)
            if chunk.usage:
                usage_tokens = chunk.usage.completion_tokens
                rec.prompt_tokens_reported = chunk.usage.prompt_tokens
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                if details is not None and details.cached_tokens is not None:
                    rec.cached_tokens = details.cached_tokens
    except openai.APIStatusError as e:
        rec.error = f"HTTP {e.status_code}: {str(e.message)[:500]}"
    except openai.APIError as e:
        rec.error = f"{type(e).__name__}: {e}"
    attempts = sends.pop(req.index, [])
    rec.attempts = max(1, len(attempts))
    if rec.error is not None:
        return rec
    if rec.ttft is not None and attempts:
        rec.ttft_admitted = start + rec.ttft - attempts[-1]
    return _finish(rec, start, usage_tokens)


async def discover_model(client: httpx.AsyncClient, base: str) -> str:
    """The first model the server lists (llama-server, vLLM and iterserve all list one)."""
    try:
        resp = await client.get(base + "/v1/models", timeout=10.0)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise BenchClientError(
            f"could not read a model name from {base}/v1/models ({e}); pass --model") from e


async def run_workload(base_url: str, workload: Workload, opts: ClientOptions | None = None,
                       slo: SLO = SLO()) -> dict:
    """Run `workload` against the server at `base_url`; return the result document."""
    opts = (opts or ClientOptions()).validate()
    base = _normalise_base_url(base_url)
    url = base + ENDPOINTS[opts.endpoint]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(opts.request_timeout_s, connect=30.0)
    sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    sends: dict[int, list[float]] = {}
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client, \
            _openai_client(base, opts, sends) as sdk:
        model = opts.model or await discover_model(client, base)

        async def one(req: BenchRequest, t0: float) -> RequestRecord:
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await _bounded(req, t0)
            async with sem:
                return await _bounded(req, t0)

        async def _bounded(req: BenchRequest, t0: float) -> RequestRecord:
            try:
                call = (stream_one(client, url, req, model, opts, t0) if sdk is None else
                        stream_one_openai(sdk, req, model, opts, t0, sends))
                return await asyncio.wait_for(call, opts.request_timeout_s)
            except asyncio.TimeoutError:
                return RequestRecord(index=req.index, prompt_len=req.prompt_len,
                                     max_tokens=req.max_tokens, scheduled_s=req.arrival_s,
                                     error=f"timed out after {opts.request_timeout_s}s",
                                     attempts=max(1, len(sends.pop(req.index, ()))))

        started_at = time.time()
        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(r, t0) for r in workload.requests))
        duration = time.perf_counter() - t0
    records = sorted(records, key=lambda r: r.index)
    return {
        "kind": "serve", "base_url": base, "endpoint": opts.endpoint, "model": model,
        "started_at": started_at, "machine": machine_info(), "workload": workload.summary(),
        "options": {"max_concurrency": opts.max_concurrency, "ignore_eos": opts.ignore_eos,
                    "temperature": opts.temperature, "client": opts.client,
                    "max_retries": opts.max_retries if opts.client == "openai" else 0},
        "summary": summarize(records, duration, slo),
        "requests": [r.to_json() for r in records],
    }


@contextlib.asynccontextmanager
async def _openai_client(base: str, opts: ClientOptions, sends: dict[int, list[float]]):
    """The official SDK's client when `opts.client` is "openai", else None. A request hook
    notes when each attempt went out, keyed by the benchmark request it belongs to."""
    if opts.client != "openai":
        yield None
        return
    import httpx2
    import openai

    async def on_request(request) -> None:
        index = request.headers.get(ATTEMPT_HEADER)
        if index is not None:
            sends.setdefault(int(index), []).append(time.perf_counter())

    http = httpx2.AsyncClient(
        event_hooks={"request": [on_request]},
        limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None),
        timeout=httpx2.Timeout(opts.request_timeout_s, connect=30.0))
    sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="bench",
                             max_retries=opts.max_retries, http_client=http)
    try:
        yield sdk
    finally:
        await sdk.close()


def run_sweep(base_url: str, workload_name: str, rates: list[float], slo: SLO,
              opts: ClientOptions | None = None, seed: int = 0,
              num_requests: int | None = None) -> dict:
    """Run the workload at each rate (ascending) and report the capacity: the highest rate
    whose run met the SLOs (p99 TTFT and p99 ITL, no failures)."""
    if not rates:
        raise BenchClientError("a sweep needs at least one rate")
    if slo.ttft_s is None and slo.itl_s is None:
        raise BenchClientError("a rate sweep needs --slo (ttft:MS and/or itl:MS) to find capacity")
    runs = []
    for rate in sorted(rates):
        w = build_workload(workload_name, seed=seed, rate=rate, num_requests=num_requests)
        res = asyncio.run(run_workload(base_url, w, opts, slo))
        runs.append({"rate": rate, "summary": res["summary"]})
    met = [r["rate"] for r in runs if r["summary"]["slo_met"]]
    return {"kind": "serve-sweep", "base_url": _normalise_base_url(base_url),
            "workload": workload_name, "slo": slo.to_json(), "machine": machine_info(),
            "runs": runs, "capacity_rps": max(met) if met else None}


def parse_rates(spec: str) -> list[float]:
    """``1,2,4`` -> [1.0, 2.0, 4.0]; every rate positive and finite."""
    try:
        rates = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise BenchClientError(f"rates must be comma-separated numbers, got {spec!r}") from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise BenchClientError(f"rates must be positive finite numbers, got {spec!r}")
    return rates
