"""`--omp-wait-policy`: what idle OpenMP threads do, decided before torch loads libgomp.

Why a knob: the CPU kernels (and torch) run each parallel region on libgomp's thread pool.
By default (OMP_WAIT_POLICY unset) libgomp's idle threads spin for a while before they sleep;
on an idle machine that makes the hand-off between the ~200 parallel regions of a decode
step cheap, but on a machine whose cores other processes use, a spinning thread holds a core
that the thread it waits for needs: a bundled-model batch-1 step went from ~1 s to 11-65 ms
with OMP_WAIT_POLICY=PASSIVE at load average 20. libgomp reads the variable once,
when it is loaded (with torch), so the policy must be in the environment before that:
`iterserve serve` calls `apply` first thing. An OMP_WAIT_POLICY already in the environment
always wins (the user said so explicitly). torch-free on purpose.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Mapping

from iterserve import envs
from iterserve.model.contention import cgroup_quota, usable_cpus   # torch-free

logger = logging.getLogger(__name__)


def decide(policy: str, env: Mapping[str, str] | None = None, load1: float | None = None,
           cpus: int | None = None, quota: float | None | bool = False) -> str | None:
    """The OMP_WAIT_POLICY value to set (None: leave the environment as it is); `env`
    stands for this process's environment in tests, `quota` for the cgroup's CPU quota
    (False: read it). `auto` is passive when the load average at start is at least the
    usable CPUs, or when a cgroup CPU quota applies: a spinning thread spends the quota's
    time doing nothing, and the whole team then waits out the period throttled."""
    policy = str(policy).lower()
    if policy == "env" or envs.is_set("OMP_WAIT_POLICY", env):
        return None
    if policy == "auto":
        load1 = os.getloadavg()[0] if load1 is None else load1
        cpus = usable_cpus() if cpus is None else cpus
        quota = cgroup_quota() if quota is False else quota
        return "PASSIVE" if load1 >= cpus or quota is not None else None
    if policy in ("active", "passive"):
        return policy.upper()
    raise ValueError(f"omp_wait_policy must be env, auto, active or passive, not {policy!r}")


def apply(policy: str) -> str | None:
    """Set OMP_WAIT_POLICY for this process per `policy`; returns the value it now has."""
    value = decide(policy)
    if value is not None:
        if "torch" in sys.modules:   # libgomp is loaded: too late for this process
            logger.warning("--omp-wait-policy %s: torch is already imported, so OpenMP keeps "
                           "its policy; set OMP_WAIT_POLICY=%s in the environment instead",
                           policy, value)
            return envs.OMP_WAIT_POLICY
        envs.export("OMP_WAIT_POLICY", value)
        logger.info("OMP_WAIT_POLICY=%s (--omp-wait-policy %s)", value, policy)
    return envs.OMP_WAIT_POLICY
