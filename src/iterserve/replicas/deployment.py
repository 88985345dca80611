"""One engine replica as a Ray Serve deployment replica: its own process, its own OpenMP
team, its own KV pool, its own `AsyncEngine`.

Why a Serve deployment and not hand-made actors: Ray Serve already restarts a replica that
dies (health checks, the controller's reconcile loop), streams a generator's items back to a
`DeploymentHandle`, propagates a caller's cancellation into the replica's task, and lets us
plug our own request router (replicas/request_router.py). We add only the engine.

The replica speaks in token ids: the driver (replicas/pool.py) tokenises, so the router can
hash the prompt's blocks, and the replica's engine validates and runs the request exactly as
a single-process server would. `generate` is an async generator whose first item is the
acceptance (the prompt ids and this replica's id): validation errors (a too-long prompt, a
full queue) raise before it, so the pool can raise them before the first output, as
`AsyncEngine.generate` does. Leaving the stream early (the driver cancels it: a client went
away, an abort) closes the engine stream, which aborts the request and frees its blocks
before the next step.

`record_routing_stats` is Ray Serve's hook: the controller calls it every
`request_routing_stats_period_s` and hands the dict to every router (core/router.py's
ReplicaLoad fields).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, AsyncIterator

from iterserve import envs
from iterserve.engine.async_engine import AsyncEngine
from iterserve.errors import QueueFullError, ReplicaDiedError

logger = logging.getLogger(__name__)


class StepStatsBuffer:
    """A stat logger (engine/metrics.py StatLogger) that keeps the StepStats the driver has
    not yet fetched, bounded so an unread buffer cannot grow without end."""

    def __init__(self, limit: int = 10_000) -> None:
        self._items: list[Any] = []
        self._lock = threading.Lock()
        self.limit = limit
        self.num_dropped = 0

    def log(self, stats: Any) -> None:               # engine thread
        with self._lock:
            self._items.append(stats)
            if len(self._items) > self.limit:
                del self._items[0]
                self.num_dropped += 1

    def drain(self) -> list[Any]:
        with self._lock:
            items, self._items = self._items, []
        return items


def bind_serve_grpc_to_loopback() -> bool:
    """In a single-node cluster (replicas/launch.py), the replica's inter-deployment gRPC
    server listens on 127.0.0.1 rather than on every interface.

    Why here: Ray Serve's replica adds that server's port as "[::]:0", whatever the node's
    IP (ray 2.60, serve/_private/replica.py), after the deployment's constructor has run and
    by a name looked up in its module; so the constructor swaps that name for one that maps
    an all-interfaces host to loopback. Only under launch.py's single-node switch: on a
    cluster the user formed (--ray-address) Serve's own binding stands. True when applied.
    If a Ray release moves the call, launch.check_loopback still refuses an exposed port."""
    from iterserve.replicas.launch import SINGLE_NODE_ENV

    if envs.get(SINGLE_NODE_ENV) != "0":
        return False
    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:
        return False
    inner = getattr(serve_replica, "add_port_to_grpc_server", None)
    if inner is None:
        return False
    if getattr(inner, "loopback_only", False):
        return True

    def add_port_on_loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", "", "[::0]"):
            address = f"127.0.0.1:{port}"
        return inner(server, address)

    add_port_on_loopback.loopback_only = True       # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_port_on_loopback
    return True


class EngineReplica:
    """The deployment class (wrapped by `serve.deployment` in replicas/pool.py)."""

    def __init__(self, engine_args: Any, threads: int | None = None,
                 debug_check_consistency: bool = False) -> None:
        bind_serve_grpc_to_loopback()
        if threads:
            # OMP_NUM_THREADS also comes through the runtime env (before torch is imported);
            # set_num_threads covers a process that imported torch already.
            envs.export("OMP_NUM_THREADS", threads)
            import torch
            torch.set_num_threads(threads)
        from ray import serve

        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:                             # outside Serve (unit use)
            self.replica_id = f"local-{os.getpid()}"
        self.threads = threads
        self.engine = AsyncEngine.from_engine_args(
            engine_args.replace(data_parallel_size=1),
            debug_check_consistency=debug_check_consistency)
        self.step_stats = StepStatsBuffer()
        self.engine.add_stat_logger(self.step_stats)
        # The loop starts with the first request; the grammar compiler is warmed now, so
        # the replica's first constrained request stalls nobody (async_engine.py).
        self.engine.warm_structured_outputs()
        core = self.engine.engine
        self.max_num_seqs = core.scheduler_config.max_num_seqs if core.scheduler_config else 0
        logger.info("iterserve replica %s: pid %d, %s threads", self.replica_id, os.getpid(),
                    threads or "default")

    # --- what the pool reads once ----------------------------------------------------------
    def info(self) -> dict[str, Any]:
        core = self.engine.engine
        cache = core.cache_config
        return {"replica_id": self.replica_id, "pid": os.getpid(), "threads": self.threads,
                "model_name": self.engine.model_name, "tokenizer": self.engine.tokenizer,
                "max_model_len": self.engine.max_model_len,
                "vocab_size": self.engine.vocab_size,
                "scheduling_policy": self.engine.scheduling_policy,
                "block_size": cache.block_size if cache else 16,
                "num_kv_blocks": cache.num_kv_blocks if cache else None,
                "max_num_seqs": self.max_num_seqs}

    # --- requests --------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any,
                       kw: dict[str, Any], target_replica: str | None = None,
                       exclude_replicas: tuple[str, ...] = ()) -> AsyncIterator[Any]:
        """Accept the request (raising its validation error), yield ("accepted", replica id,
        prompt ids), then every RequestOutput. `target_replica` / `exclude_replicas` are
        read by the request router only."""

        try:
            stream = await self.engine.generate(prompt_token_ids, params,
                                                request_id=request_id, **kw)
        except QueueFullError as e:
            e.replica_id = self.replica_id            # the pool retries on another replica
            raise
        try:
            yield ("accepted", self.replica_id, list(prompt_token_ids))
            async for out in stream:
                yield out
        finally:
            await stream.aclose()                     # unfinished: aborts, frees the blocks

    async def abort(self, request_id: str, target_replica: str | None = None) -> bool:
        self.engine.abort(request_id)           # harmless on a replica that lacks the id
        return True

    def _for_me(self, target_replica: str | None) -> None:
        """A per-replica call routed here because its target is gone fails, rather than
        answer with another replica's numbers."""
        if target_replica is not None and target_replica != self.replica_id:
            raise ReplicaDiedError(f"replica {target_replica} is gone (answered by "
                                   f"{self.replica_id})")

    # --- observability ---------------------------------------------------------------------
    def _cache_counts(self) -> tuple[int, int]:
        bm = getattr(getattr(self.engine.engine, "scheduler", None), "block_manager", None)
        return (getattr(bm, "num_cache_hits", 0), getattr(bm, "num_cache_queries", 0))

    async def scheduler_stats(self, target_replica: str | None = None) -> dict[str, Any]:
        self._for_me(target_replica)
        s = await self.engine.scheduler_stats()
        hits, queries = self._cache_counts()
        return {"replica_id": self.replica_id, "stats": s, "num_cache_hits": hits,
                "num_cache_queries": queries, "step_stats": self.step_stats.drain(),
                "num_in_flight": self.engine.num_in_flight}

    async def stats(self, target_replica: str | None = None) -> dict[str, Any]:
        self._for_me(target_replica)
        snap = await self.engine.stats()
        hits, queries = self._cache_counts()
        snap.update(replica_id=self.replica_id, pid=os.getpid(), threads=self.threads,
                    num_cache_hits=hits, num_cache_queries=queries,
                    health_violations=list(self.engine.health_violations))
        return snap

    async def get_trace(self, request_id: str, target_replica: str | None = None
                        ) -> dict[str, Any] | None:
        self._for_me(target_replica)
        return await self.engine.get_trace(request_id)

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing-stats hook (core/router.py ReplicaLoad fields). Read without the
        engine thread: plain attribute reads of the scheduler's lists are consistent enough
        for routing, and never wait behind a step."""
        sched = getattr(self.engine.engine, "scheduler", None)
        bm = getattr(sched, "block_manager", None)
        try:
            s = sched.stats()
            return {"num_running": s.num_running, "num_waiting": s.num_waiting,
                    "kv_usage": s.kv_usage, "max_num_seqs": self.max_num_seqs,
                    "num_in_flight": self.engine.num_in_flight}
        except Exception:                              # mid-step mutation: report in-flight
            return {"num_running": self.engine.num_in_flight, "num_waiting": 0,
                    "kv_usage": 0.0 if bm is None else 0.0, "max_num_seqs": self.max_num_seqs,
                    "num_in_flight": self.engine.num_in_flight}

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop died is restarted."""
        if self.engine.is_closed:
            raise RuntimeError("the engine is shut down")
        loop_task = self.engine._loop_task
        if loop_task is not None and loop_task.done():
            raise RuntimeError("the engine loop stopped")

    async def __del__(self) -> None:   # noqa: D105 - Serve calls it on graceful shutdown
        try:
            await self.engine.shutdown()
        except Exception:
            pass
