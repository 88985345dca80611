"""ReplicaPool: AsyncEngine's public API over N engine replicas on Ray Serve.

The HTTP server (server/app.py) is handed a ReplicaPool where it would get an AsyncEngine and
does not learn about replicas. The pool tokenises and renders chat templates in the server
process (the tokenizer comes from a replica, so both sides use the same one), and sends token
ids through a Ray Serve `DeploymentHandle` with `stream=True`; Serve's request router - ours,
replicas/request_router.py - picks the replica by core/router.py's policy.

What each piece of the single-server behaviour becomes:
- validation errors raise before the first output: the replica's stream yields an
  acceptance first, and the pool awaits it in `generate`;
- back-pressure: a replica whose queue is full refuses with QueueFullError; the pool retries
  with that replica excluded and answers 503 only when every replica refused;
- abort (client disconnect, generator closed): the pool cancels the handle's stream, Serve
  cancels the replica's task, and the replica's `finally` aborts the request in its engine;
- faults: a replica that dies mid-stream ends its streams with ReplicaDiedError (an SSE error
  chunk, or a 503 for a non-streaming request); Ray Serve restarts the replica, and the
  router stops sending there at once;
- stats: `scheduler_stats()` sums the replicas (it also feeds each replica's step stats to
  the server's Prometheus logger: the sums, and the per-replica series with a `replica`
  label); `stats()` is the summed live view plus each replica's own under "replicas".
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Callable, Sequence

from iterserve.core.request import SamplingParams
from iterserve.core.scheduler import SchedulerStats
from iterserve.engine.async_engine import AsyncEngine
from iterserve.errors import (EmptyPromptError, EngineDeadError, PromptTooLongError,
                              QueueFullError, ReplicaDiedError)

logger = logging.getLogger(__name__)


class _DriverView:
    """What AsyncEngine's text methods read from an engine (tokenizer, limits, loggers), for
    a pool that has no engine in this process."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.model_name = info["model_name"]
        self.tokenizer = info["tokenizer"]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.stat_loggers: list[Any] = []

    def fatal_error(self) -> str | None:
        return None             # a dead replica is restarted by Ray; the pool keeps serving


def unwrap(exc: BaseException) -> BaseException:
    """The exception to raise for what a Serve handle raised: the replica's own error (a
    validation error, QueueFullError) as itself; a dead or unreachable replica as
    ReplicaDiedError."""
    import ray.exceptions as rex

    if isinstance(exc, rex.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and not isinstance(cause, rex.RayError):
            return cause
        if isinstance(cause, BaseException):
            return unwrap(cause)
    if isinstance(exc, (rex.RayActorError, rex.ActorUnavailableError, rex.ObjectLostError,
                        rex.WorkerCrashedError, rex.NodeDiedError)):
        return ReplicaDiedError(f"the replica serving this request died: "
                                f"{type(exc).__name__}")
    if isinstance(exc, rex.RayError):
        return ReplicaDiedError(f"the replica failed: {type(exc).__name__}: {exc}")
    return exc


@dataclasses.dataclass
class _InFlight:
    gen: Any                      # DeploymentResponseGenerator
    replica: str


class ReplicaPool(AsyncEngine):
    """AsyncEngine's public API over a Ray Serve deployment of EngineReplica."""

    def __init__(self, handle: Any, info: dict[str, Any], *, router_key: str,
                 num_replicas: int, app_name: str, owns_ray: bool = False,
                 accept_timeout: float = 60.0, control_timeout: float = 5.0,
                 poll_interval: float = 0.5) -> None:
        super().__init__(_DriverView(info), scheduling_policy=info["scheduling_policy"])
        self.handle = handle
        self.info = info
        self.router_key = router_key
        self.num_replicas = num_replicas
        self.app_name = app_name
        self.owns_ray = owns_ray
        self.accept_timeout = accept_timeout
        self.control_timeout = control_timeout
        self.poll_interval = poll_interval
        self.block_size = info.get("block_size", 16)
        self._gen_handle = handle.options(stream=True, method_name="generate")
        self._inflight: dict[str, _InFlight] = {}
        self._served_by: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._poll_task: asyncio.Task | None = None
        self._replica_loggers: dict[str, Any] = {}
        self._per_replica: list[Callable[[str, str], Any]] = []   # add_stat_logger's factories
        self._last: dict[str, dict[str, Any]] = {}     # replica id -> last scheduler_stats
        self.num_retries_queue_full = 0
        self.num_replica_failures = 0

    # --- replicas ---------------------------------------------------------------------------
    @property
    def router(self) -> Any:
        from iterserve.replicas.request_router import ROUTERS  # ray: Serve's router class
        return ROUTERS.get(self.router_key)

    def replica_ids(self) -> list[str]:
        r = self.router
        return r.replica_ids() if r is not None else []

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    @property
    def is_running(self) -> bool:
        return self._poll_task is not None and not self._poll_task.done()

    async def _call(self, method: str, replica: str, **kw: Any) -> Any:
        resp = self.handle.options(method_name=method).remote(target_replica=replica, **kw)
        try:
            return await asyncio.wait_for(resp, timeout=self.control_timeout)
        except asyncio.TimeoutError:
            resp.cancel()
            raise ReplicaDiedError(f"replica {replica} did not answer {method} within "
                                   f"{self.control_timeout:g} s") from None
        except Exception as e:
            raise unwrap(e) from e

    async def _each(self, method: str, **kw: Any) -> dict[str, Any]:
        """`method` on every live replica: {replica id: result}; failures are left out."""
        ids = self.replica_ids()
        results = await asyncio.gather(*(self._call(method, r, **kw) for r in ids),
                                       return_exceptions=True)
        out = {}
        for rid, res in zip(ids, results):
            if isinstance(res, BaseException):
                logger.warning("replica %s: %s failed: %s", rid, method, res)
            else:
                out[rid] = res
        return out

    # --- the loop: keep the step stats flowing -----------------------------------------------
    def start(self) -> None:
        if self.is_running or self._closed:
            return
        self._loop = asyncio.get_running_loop()
        self._poll_task = self._loop.create_task(self._poll(), name="iterserve-replica-poll")

    async def _poll(self) -> None:
        while not self._closed:
            try:
                await self.scheduler_stats()
            except Exception:
                logger.debug("polling the replicas failed", exc_info=True)
            await asyncio.sleep(self.poll_interval)

    def add_stat_logger(self, stat_logger: Any, *,
                        per_replica: Callable[[str, str], Any] | None = None) -> None:
        """The server's logger gets every replica's step stats (the sums); with a
        `per_replica(model_name, replica)` factory (the server's PrometheusStatLogger
        gives one), each replica also gets its own series, from the first factory given."""
        self.engine.stat_loggers.append(stat_logger)
        if per_replica is not None:
            self._per_replica.append(per_replica)

    def _replica_logger(self, replica: str) -> Any | None:
        if replica in self._replica_loggers:
            return self._replica_loggers[replica]
        logger_ = self._per_replica[0](self.model_name, replica) if self._per_replica else None
        self._replica_loggers[replica] = logger_
        return logger_

    async def scheduler_stats(self) -> Any:
        """The replicas' SchedulerStats summed (KV usage over all their blocks, the prefix-
        cache hit rate over all their lookups); feeds the step stats to the loggers."""
        got = await self._each("scheduler_stats")
        for rid, res in got.items():
            per = self._replica_logger(rid)
            for st in res["step_stats"]:
                for lg in self.engine.stat_loggers:
                    try:
                        lg.log(st)
                    except Exception:
                        logger.exception("stat logger failed")
                if per is not None:
                    per.log(st)
            s = res["stats"]
            if per is not None:
                per.set_gauges(num_running=s.num_running, num_waiting=s.num_waiting,
                               num_swapped=s.num_swapped, kv_cache_usage=s.kv_usage,
                               num_free_blocks=s.num_free_blocks)
            self._last[rid] = res
        for rid in list(self._last):
            if rid not in got:
                self._last.pop(rid)
        return self._summed([r["stats"] for r in got.values()],
                            sum(r["num_cache_hits"] for r in got.values()),
                            sum(r["num_cache_queries"] for r in got.values()), SchedulerStats)

    @staticmethod
    def _summed(stats: Sequence[Any], hits: int, queries: int, cls: Any) -> Any:
        blocks = sum(s.num_blocks for s in stats)
        used = sum(s.kv_usage * s.num_blocks for s in stats)
        return cls(step=max((s.step for s in stats), default=0),
                   num_running=sum(s.num_running for s in stats),
                   num_waiting=sum(s.num_waiting for s in stats),
                   num_swapped=sum(s.num_swapped for s in stats),
                   kv_usage=used / blocks if blocks else 0.0,
                   num_free_blocks=sum(s.num_free_blocks for s in stats), num_blocks=blocks,
                   num_batched_tokens=sum(s.num_batched_tokens for s in stats),
                   num_preemptions=sum(s.num_preemptions for s in stats),
                   num_preemptions_total=sum(s.num_preemptions_total for s in stats),
                   prefix_cache_hit_rate=hits / queries if queries else 0.0)

    async def stats(self) -> dict[str, Any]:
        """The live view summed over the replicas, each replica's own under "replicas"."""
        snaps = await self._each("stats")
        reps = [snaps[k] for k in sorted(snaps)]
        keys = ("num_running", "num_waiting", "num_swapped", "num_free_blocks", "num_blocks",
                "num_preemptions_total", "num_cache_hits", "num_cache_queries")
        out: dict[str, Any] = {"model": self.model_name,
                               "step": max((r.get("step", 0) for r in reps), default=0)}
        for k in keys:
            out[k] = sum(r.get(k, 0) or 0 for r in reps)
        used = sum((r.get("kv_cache_usage", 0) or 0) * (r.get("num_blocks", 0) or 0)
                   for r in reps)
        out["kv_cache_usage"] = used / out["num_blocks"] if out["num_blocks"] else 0.0
        out["prefix_cache_hit_rate"] = (out["num_cache_hits"] / out["num_cache_queries"]
                                        if out["num_cache_queries"] else 0.0)
        out["history"] = sorted((h for r in reps for h in r.get("history", [])),
                                key=lambda h: h.get("time", 0) if isinstance(h, dict) else 0)
        out["recent_requests"] = [t for r in reps for t in r.get("recent_requests", [])][:20]
        out["num_replicas"] = len(reps)
        out["router"] = getattr(self.router, "policy", None)
        out["router_decision"] = self.router.overhead() if self.router is not None else None
        out["threads_per_replica"] = getattr(self, "threads_per_replica", None)
        out["replicas"] = reps
        return out

    async def get_trace(self, request_id: str) -> dict[str, Any] | None:
        replica = self._served_by.get(request_id)
        if request_id in self._inflight:
            replica = self._inflight[request_id].replica
        targets = [replica] if replica else self.replica_ids()
        for rid in targets:
            try:
                t = await self._call("get_trace", rid, request_id=request_id)
            except Exception:
                continue
            if t is not None:
                t.setdefault("replica", rid)
                return t
        return None

    async def check_health(self) -> list[str]:
        """Each replica's consistency violations so far, prefixed by its id."""
        return [f"replica {rid}: {v}" for rid, snap in (await self._each("stats")).items()
                for v in snap.get("health_violations", [])]

    # --- requests ---------------------------------------------------------------------------
    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, **kw: Any) -> AsyncIterator[Any]:
        """As AsyncEngine.generate: validation errors (from the tokenizer here, or from the
        replica's engine) raise before the first output; leaving the stream aborts."""

        if not self._accepting or self._closed:
            raise EngineDeadError("the server is shutting down")
        request_id = request_id or self.next_request_id()
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("the prompt is empty", "prompt")
            kw.setdefault("prompt_text", prompt)
            ids = await self.tokenize(prompt, limit=self.max_model_len)
        else:
            if len(prompt) >= self.max_model_len:
                raise PromptTooLongError(
                    f"the prompt has {len(prompt)} tokens, but this model's maximum context "
                    f"length is {self.max_model_len} tokens (prompt and output together)",
                    "prompt")
            ids = list(prompt)
        self.start()
        excluded: list[str] = []
        while True:
            gen = self._gen_handle.remote(request_id=request_id, prompt_token_ids=ids,
                                          params=params, kw=kw,
                                          exclude_replicas=tuple(excluded))
            try:
                first = await asyncio.wait_for(gen.__anext__(), timeout=self.accept_timeout)
            except asyncio.TimeoutError:
                gen.cancel()
                raise ReplicaDiedError(f"no replica accepted the request within "
                                       f"{self.accept_timeout:g} s") from None
            except BaseException as e:
                err = unwrap(e)
                if isinstance(err, QueueFullError):
                    excluded.append(getattr(err, "replica_id", "?"))
                    live = set(self.replica_ids())
                    if live and not live - set(excluded):
                        raise QueueFullError(f"every replica's queue is full "
                                             f"({len(live)} replicas)") from None
                    self.num_retries_queue_full += 1
                    continue
                if isinstance(err, ReplicaDiedError):
                    self.num_replica_failures += 1
                if err is e:
                    raise
                raise err from None
            break
        _, replica, _prompt_ids = first
        self._inflight[request_id] = _InFlight(gen, replica)
        self._served_by[request_id] = replica
        while len(self._served_by) > 10_000:
            self._served_by.popitem(last=False)
        return self._stream(request_id, gen, replica)

    async def _stream(self, request_id: str, gen: Any, replica: str
                      ) -> AsyncIterator[Any]:
        from ray.serve.exceptions import RequestCancelledError

        finished = False
        try:
            while True:
                try:
                    out = await gen.__anext__()
                except StopAsyncIteration:
                    break
                except RequestCancelledError:
                    if self._closed or not self._accepting:
                        raise EngineDeadError("the server is shutting down") from None
                    raise
                except asyncio.CancelledError:
                    raise
                except BaseException as e:
                    err = unwrap(e)
                    if isinstance(err, ReplicaDiedError):
                        self.num_replica_failures += 1
                        err = ReplicaDiedError(f"replica {replica} died while serving request "
                                               f"{request_id}")
                    raise err from None
                finished = out.finished
                yield out
                if finished:
                    return
            if not finished:
                raise ReplicaDiedError(f"replica {replica} ended request {request_id}'s "
                                       "stream before it finished")
        finally:
            self._inflight.pop(request_id, None)
            if not finished:
                gen.cancel()        # Serve cancels the replica's task: its engine aborts

    def abort(self, request_id: str) -> None:
        """Abort from any context: cancel the stream; the replica aborts in its engine."""
        entry = self._inflight.pop(request_id, None)
        if entry is not None:
            entry.gen.cancel()

    async def shutdown(self, *, abort_in_flight: bool = True, drain_timeout: float = 0.0,
                       abort_grace: float = 0.5) -> None:
        """Stop accepting, let in-flight requests finish for `drain_timeout` s, then cancel
        the rest (their streams end with finish_reason "abort" through the server's
        EngineDeadError path), stop polling. The Serve application and Ray are torn down by
        `close()` (replicas/launch.py), which the CLI calls after the server stops."""
        if self._closed:
            return
        self._accepting = False
        loop = asyncio.get_running_loop()
        if drain_timeout > 0:
            deadline = loop.time() + drain_timeout
            while self._inflight and loop.time() < deadline:
                await asyncio.sleep(0.02)
        if abort_in_flight:
            for rid in list(self._inflight):
                entry = self._inflight.get(rid)
                if entry is not None:
                    entry.gen.cancel()
            deadline = loop.time() + abort_grace
            while self._inflight and loop.time() < deadline:
                await asyncio.sleep(0.01)
        self._closed = True
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
        self._text.shutdown(wait=False, cancel_futures=True)
        self._thread.shutdown(wait=False)

    def wait_for_replicas(self, n: int | None = None, timeout: float = 60.0) -> list[str]:
        """Block until the router sees `n` (default: all) replicas; returns their ids."""
        n = self.num_replicas if n is None else n
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids = self.replica_ids()
            if len(ids) >= n:
                return ids
            time.sleep(0.05)
        raise TimeoutError(f"only {len(self.replica_ids())} of {n} replicas after {timeout} s")
