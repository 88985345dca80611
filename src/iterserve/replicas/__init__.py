"""Data parallel: N engine replicas on Ray Serve behind the one OpenAI endpoint.

    launch.py          start_pool / close_pool: Ray (local or --ray-address), the deployment
    deployment.py      EngineReplica: one AsyncEngine per replica process
    request_router.py  the Ray Serve request router that calls core/router.py's Router
    pool.py            ReplicaPool: AsyncEngine's public API over the replicas (the server's
                       engine)

Importing this package does not import Ray; `start_pool` does (and says how to install it).
"""

from iterserve.replicas.launch import close_pool, require_ray, start_pool

__all__ = ["start_pool", "close_pool", "require_ray"]
