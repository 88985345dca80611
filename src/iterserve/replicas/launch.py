"""Start N engine replicas on Ray Serve and return the pool the server talks to.

    start_pool(engine_args, ray_address=None) -> ReplicaPool     (close_pool(pool) to stop)

Ray: `ray_address` joins an existing cluster (`ray start --head` elsewhere, or "auto");
without one a local cluster is started, kept light: no dashboard, a small object store (the
replicas exchange token ids and RequestOutputs, a few KB each), and as many logical CPUs as
the replicas' threads need. Serve runs without its HTTP proxy: the HTTP front is iterserve's
own FastAPI app in this process, and only the replicas are Serve deployments.

A local cluster listens on the loopback interface only. Why: Ray's servers (GCS, raylet,
core workers, the dashboard agent, the runtime-env agent) bind to the node's IP address, and
whoever reaches them can run code on the machine; `ray.init` resolves the node's IP from the
route to the outside world even when told 127.0.0.1 (`resolve_ip_for_localhost`). Ray's own
single-node switch (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, the mode Ray uses on laptops)
makes the node's IP 127.0.0.1, and every server then binds there. `check_loopback` lists the
sockets of the processes Ray started and refuses to go on if any listens elsewhere. A
multi-node cluster is the user's choice: `--ray-address` (README, "Scale-out", lists the
ports such a cluster opens).

Threads: each replica is a process with its own OpenMP team of `--threads-per-replica`
threads (default: the cores / replicas, at least 1), set through the replica's runtime env
(OMP_NUM_THREADS, before torch starts) and torch.set_num_threads.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from iterserve import envs
from iterserve.errors import RayExposedError, RayNotInstalledError
from iterserve.replicas.deployment import EngineReplica
from iterserve.replicas.pool import ReplicaPool


logger = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 128 << 20
ROUTING_STATS_PERIOD_S = 0.2


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise RayNotInstalledError(
            "--data-parallel-size > 1 runs the replicas on Ray Serve, which is not installed: "
            "pip install 'iterserve[ray]' (or 'ray[serve]==2.60.0')") from e


def default_threads(num_replicas: int) -> int:
    return max(1, (os.cpu_count() or 1) // num_replicas)


SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _single_node_ray() -> None:
    """Ray's single-node mode: the node's IP is 127.0.0.1, so its servers bind there. The
    variable is read when `ray` is imported (it may be already) and by the processes Ray
    starts, so both are set."""
    envs.export(SINGLE_NODE_ENV, 0)
    try:
        from ray._private import ray_constants
        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):    # another Ray layout: check_loopback decides
        logger.debug("Ray's single-node switch not found", exc_info=True)


def init_ray(ray_address: str | None, *, num_cpus: int) -> bool:
    """Connect to (or start) Ray; True when this call started a local cluster (which listens
    on 127.0.0.1 only: the module docstring)."""
    import ray

    if ray.is_initialized():
        return False
    if ray_address:
        ray.init(address=ray_address, log_to_driver=False)
        return False
    _single_node_ray()
    ray.init(num_cpus=num_cpus, object_store_memory=OBJECT_STORE_BYTES,
             include_dashboard=False, dashboard_host="127.0.0.1", log_to_driver=False,
             configure_logging=True, logging_level=logging.WARNING)
    return True


def listening_sockets(pid: int | None = None) -> list[tuple[str, int, int, str]]:
    """(address, port, pid, process name) of every TCP socket listening in process `pid`
    (default: this one) and its descendants, Ray's servers and workers included."""
    import psutil

    root = psutil.Process(pid)
    pids = {root.pid} | {p.pid for p in root.children(recursive=True)}
    out = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = psutil.Process(c.pid).name()
            except psutil.Error:
                name = "?"
            out.append((c.laddr.ip, c.laddr.port, c.pid, name))
    return sorted(out)


def is_loopback(address: str) -> bool:
    import ipaddress
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def check_loopback() -> None:
    """Raise if this process or one it started listens beyond the loopback interface (run
    before the HTTP server binds its --host)."""
    exposed = [s for s in listening_sockets() if not is_loopback(s[0])]
    if exposed:
        shown = ", ".join(f"{a}:{p} ({name})" for a, p, _, name in exposed[:8])
        raise RayExposedError(
            f"the local Ray cluster listens beyond 127.0.0.1 ({shown}); refusing to serve. "
            "Use --ray-address to run on a cluster you set up and firewall yourself")


def start_pool(engine_args: Any, *, ray_address: str | None = None,
               threads_per_replica: int | None = None, debug_check_consistency: bool = False,
               app_name: str | None = None, accept_timeout: float = 60.0,
               health_check_period_s: float = 1.0) -> Any:
    """Deploy `engine_args.data_parallel_size` replicas and return their ReplicaPool."""
    require_ray()
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    parallel = engine_args.create_parallel_config()
    n = parallel.data_parallel_size
    if engine_args.model and not os.path.exists(engine_args.model):
        # Here, not in N replica constructors that Serve would retry.
        raise FileNotFoundError(f"no model at {engine_args.model!r}")
    threads = threads_per_replica or parallel.threads_per_replica or default_threads(n)
    owns_ray = init_ray(ray_address, num_cpus=max(os.cpu_count() or 1, n * threads))
    serve.start(proxy_location="Disabled")
    app_name = app_name or f"iterserve-{uuid.uuid4().hex[:8]}"
    router_key = f"{app_name}/router"
    policy = str(getattr(parallel.router, "value", parallel.router))
    deployment = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=n,
        # Back-pressure is the engine's (max_queued_requests): Serve must not queue first.
        max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": threads,
                           "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}},
        health_check_period_s=health_check_period_s, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=2, graceful_shutdown_wait_loop_s=0.2,
        max_constructor_retry_count=2,
        request_router_config=RequestRouterConfig(
            request_router_class="iterserve.replicas.request_router.IterserveRequestRouter",
            request_router_kwargs={"policy": policy, "block_size": engine_args.block_size,
                                   "cache_capacity_blocks": engine_args.num_kv_blocks,
                                   "seed": engine_args.seed, "registry_key": router_key},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=2.0))
    args = engine_args.replace(data_parallel_size=1)
    handle = serve.run(deployment.bind(args, threads, debug_check_consistency),
                       name=app_name, route_prefix=None)
    info = handle.info.remote().result(timeout_s=120)
    pool = ReplicaPool(handle, info, router_key=router_key, num_replicas=n, app_name=app_name,
                       owns_ray=owns_ray, accept_timeout=accept_timeout)
    pool.threads_per_replica = threads
    pool.wait_for_replicas()
    if owns_ray:
        try:
            check_loopback()
        except RayExposedError:
            close_pool(pool)
            raise
    logger.info("iterserve: %d replicas of %r on Ray Serve (%d threads each, router %s)",
                n, info["model_name"], threads, policy)
    return pool


def close_pool(pool: Any, *, shutdown_ray: bool | None = None) -> None:
    """Delete the Serve application; stop Serve and Ray too when this process started them
    (or when `shutdown_ray` says so)."""
    import ray
    from ray import serve

    from iterserve.replicas.request_router import ROUTERS  # ray: Serve's router base class

    ROUTERS.pop(pool.router_key, None)
    try:
        serve.delete(pool.app_name)
    except Exception:
        logger.debug("serve.delete failed", exc_info=True)
    if shutdown_ray if shutdown_ray is not None else pool.owns_ray:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
