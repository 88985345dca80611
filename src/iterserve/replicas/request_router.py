"""The Ray Serve request router that puts iterserve's own router (core/router.py) in charge.

Ray Serve asks `choose_replicas` which replica(s) a pending request may go to; we answer with
`core.router.Router.route(prompt_token_ids, loads)` - the same code the lab's cluster
simulation runs, so what the lab predicts is what the server does. Each replica's load is
what it reported through Serve's routing-stats hook (`EngineReplica.record_routing_stats`,
every `request_routing_stats_period_s`), corrected by what this router itself sent since:
the stats are a few hundred ms old, and without the correction a burst of requests would all
see the same "idle" replica.

The router runs in the process that holds the `DeploymentHandle` (the HTTP server), so it
also registers itself in `ROUTERS` for the pool (replicas/pool.py) to read the live replica
set from.

Two keyword arguments of a call steer it (the pool sets them; the replica ignores them):
`target_replica` (a per-replica call: stats, a trace) and `exclude_replicas` (a retry after
a replica's queue was full). A request with neither is routed by the policy.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Dict, List, Optional

from ray.serve.request_router import (FIFOMixin, PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from iterserve.core.router import ReplicaLoad, Router

logger = logging.getLogger(__name__)

ROUTERS: Dict[str, "IterserveRequestRouter"] = {}
"""The live router of each pool, by the registry key the pool passed in its kwargs."""


def make_router(policy: str, *, block_size: int, cache_capacity_blocks: int | None,
                seed: int) -> Any:
    return Router(policy, block_size=block_size, cache_capacity_blocks=cache_capacity_blocks,
                  seed=seed)


def replica_load(replica_id: str, stats: dict[str, Any], in_flight: int) -> Any:
    """A ReplicaLoad from a replica's routing stats, with at least `in_flight` requests
    (those this router sent that have not completed) counted as running or waiting."""
    running = int(stats.get("num_running", 0))
    waiting = int(stats.get("num_waiting", 0))
    if in_flight > running + waiting:
        waiting = in_flight - running
    return ReplicaLoad(replica_id=replica_id, num_running=running, num_waiting=waiting,
                       kv_usage=float(stats.get("kv_usage", 0.0)),
                       max_num_seqs=int(stats.get("max_num_seqs", 0) or 1),
                       healthy=bool(stats.get("healthy", True)))


class IterserveRequestRouter(FIFOMixin, RequestRouter):
    """Routes by core.router.Router (round_robin / least_loaded / prefix_aware)."""

    def initialize_state(self, policy: str = "least_loaded", block_size: int = 16,
                         cache_capacity_blocks: int | None = None, seed: int = 0,
                         registry_key: str | None = None, **_: Any) -> None:
        self.policy = policy
        self.router = make_router(policy, block_size=block_size,
                                  cache_capacity_blocks=cache_capacity_blocks, seed=seed)
        self._assigned: Dict[str, str] = {}        # internal request id -> replica unique id
        self._in_flight: Dict[str, int] = {}       # replica unique id -> routed, not completed
        self.num_routed = 0
        self.decision_s: collections.deque[float] = collections.deque(maxlen=10_000)
        if registry_key:
            # Through sys.modules: Serve may hand us this class unpickled by value, whose
            # functions then see a copy of this module's globals, not the module itself.
            import iterserve.replicas.request_router as this_module
            this_module.ROUTERS[registry_key] = self

    # --- the decision ----------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target_replica")
        if target:
            mine = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            # A target that is gone (killed, or restarted under a new id) would leave the
            # call unroutable, and Ray Serve retries a request that has no candidates
            # without backing off and without noticing its cancellation: a busy loop that
            # held a core for good. Any live replica takes it instead and refuses a call
            # meant for another (EngineReplica._for_me), so the caller sees it fail.
            return [mine or list(candidate_replicas)]
        t0 = time.perf_counter()
        exclude = set(kwargs.get("exclude_replicas") or ())
        cands = [r for r in candidate_replicas if r.replica_id.unique_id not in exclude]
        if not cands:
            return []
        loads = [replica_load(r.replica_id.unique_id, r.routing_stats or {},
                              self._in_flight.get(r.replica_id.unique_id, 0)) for r in cands]
        i = self.router.route(list(kwargs.get("prompt_token_ids") or ()), loads)
        chosen = cands[i]
        if pending_request is not None and pending_request.metadata.call_method == "generate":
            self._assign(pending_request.metadata.internal_request_id,
                         chosen.replica_id.unique_id)
            self.decision_s.append(time.perf_counter() - t0)
        # The chosen one first; the rest only if it cannot take the request (dead, full).
        return [[chosen], [r for r in cands if r is not chosen]]

    # --- bookkeeping -----------------------------------------------------------------------
    def _assign(self, internal_id: str, replica: str) -> None:
        old = self._assigned.get(internal_id)
        if old == replica:
            return
        if old is not None:                          # re-routed (a retry): move the count
            self._in_flight[old] = max(0, self._in_flight.get(old, 0) - 1)
        else:
            self.num_routed += 1
        self._assigned[internal_id] = replica
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        if pending_request.metadata.call_method == "generate":
            self._assign(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = self._assigned.pop(internal_request_id, None)
        if replica is not None:
            self._in_flight[replica] = max(0, self._in_flight.get(replica, 0) - 1)

    def overhead(self) -> Dict[str, Any]:
        """The routing decision's cost (loads + core Router.route), per generate request."""
        xs = sorted(self.decision_s)
        if not xs:
            return {"count": 0}
        pick = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 4)  # noqa: E731
        return {"count": len(xs), "p50_ms": pick(0.5), "p99_ms": pick(0.99),
                "max_ms": round(xs[-1] * 1e3, 4)}

    def in_flight(self) -> Dict[str, int]:
        return {k: v for k, v in self._in_flight.items() if v}

    def replica_ids(self) -> List[str]:
        """The replicas Serve currently routes to (running, not dead)."""
        return sorted(r.unique_id for r in self.curr_replicas)

    def replica_actor_names(self) -> Dict[str, str]:
        """{replica id: its Ray actor's name} (namespace "serve"), e.g. to kill one in a
        fault test."""
        return {r.unique_id: r.to_full_id_str() for r in self.curr_replicas}

    def _forget(self, replica: str) -> None:
        self._in_flight.pop(replica, None)
        for k in [k for k, v in self._assigned.items() if v == replica]:
            del self._assigned[k]
        try:
            self.router.remove_replica(replica)
        except Exception:
            logger.debug("router.remove_replica(%s) failed", replica, exc_info=True)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        before = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        after = {r.replica_id.unique_id for r in replicas}
        for gone in before - after:
            self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)
