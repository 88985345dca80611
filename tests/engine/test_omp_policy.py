"""`--omp-wait-policy` (engine/omp_policy.py): the decision, and that it reaches libgomp.

libgomp reads OMP_WAIT_POLICY once, when torch loads it, so the end-to-end test runs the real
`iterserve serve` CLI in a subprocess with OMP_DISPLAY_ENV=TRUE (libgomp prints the policy it
took at load); the model path does not exist, so the server stops right after loading torch
(~3 s). libgomp's display shows an unset policy as PASSIVE, so ACTIVE is the value that
proves the flag got there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve.engine import omp_policy

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("policy,env,load1,cpus,quota,want", [
    ("env", {}, 50.0, 2, None, None),                 # leave libgomp's default
    ("active", {}, 0.0, 2, None, "ACTIVE"),
    ("passive", {}, 0.0, 2, None, "PASSIVE"),
    ("auto", {}, 2.5, 2, None, "PASSIVE"),            # the cores are already busy
    ("auto", {}, 0.4, 2, None, None),                 # an idle machine: spin as usual
    ("auto", {}, 0.4, 2, 1.5, "PASSIVE"),             # a CPU quota: spinning spends it
    ("passive", {"OMP_WAIT_POLICY": "active"}, 0.0, 2, None, None),   # the environment wins
    ("AUTO", {}, 16.0, 16, None, "PASSIVE"),
])
def test_decide(policy, env, load1, cpus, quota, want):
    assert omp_policy.decide(policy, env, load1, cpus, quota) == want


def test_decide_rejects_unknown_policies():
    with pytest.raises(ValueError, match="omp_wait_policy"):
        omp_policy.decide("sometimes", {}, 0.0, 2)


def _serve_display(*flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(OMP_DISPLAY_ENV="TRUE", PYTHONPATH=str(SRC))
    p = subprocess.run([sys.executable, "-m", "iterserve.cli", "serve", "--model",
                        "/nonexistent/model.gguf", "--port", "18251", *flags],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "does not exist" in p.stderr
    return p.stderr


def test_serve_flag_reaches_libgomp_before_torch_loads_it():
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in _serve_display("--omp-wait-policy", "active")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" not in _serve_display()
