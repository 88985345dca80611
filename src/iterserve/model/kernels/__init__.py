"""Native CPU kernels: C sources compiled on first use with the system C compiler, loaded by ctypes.

Only one today, `qgemm.c` (GEMM over GGUF-blocked weights, see model/quant.py). Building it
takes about a second with gcc; the shared object is cached under
`$ITERSERVE_CACHE_DIR` (default `~/.cache/iterserve/kernels`) keyed by a hash of the source,
the flags and the compiler, so a changed source never loads a stale build.

It links OpenMP by soname (`libgomp.so.1`). torch's wheel ships a `libgomp.so.1` and loads it
first, so the dynamic loader reuses torch's runtime: one thread pool, not two pools spinning
against each other on few cores. ctypes releases the GIL for the call, so the server's event
loop keeps running while a step computes.

Everything degrades, never fails: no x86-64 AVX2+FMA CPU, no compiler, a failed build, or
`ITERSERVE_NATIVE_KERNELS=0` make `qgemm()` return None (the reason in `qgemm_unavailable`),
and callers use their float path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("qgemm.c")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off",
          "-shared", "-fPIC", "-Wall")

qgemm_unavailable: str | None = None   # why qgemm() returned None, for logs and benchmarks


def cache_dir() -> Path:
    root = os.environ.get("ITERSERVE_CACHE_DIR")
    if root:
        return Path(root) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "iterserve" / "kernels"


def _cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma", "f16c"} <= flags
    except OSError:
        pass
    return False


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    """Compile qgemm.c (once per source/flags/compiler) and return the cached .so path."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(_SOURCE.read_bytes() + repr(_FLAGS).encode() + version.encode()
                         ).hexdigest()[:16]
    out = cache_dir() / f"qgemm-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)          # atomic: concurrent processes never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def qgemm():
    """The loaded `iterserve_qgemm` function, or None (reason in `qgemm_unavailable`)."""
    global qgemm_unavailable
    import torch  # noqa: F401  - load torch's libgomp first, so the kernel shares its pool

    if os.environ.get("ITERSERVE_NATIVE_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        qgemm_unavailable = "disabled by ITERSERVE_NATIVE_KERNELS"
        return None
    if not _cpu_has_avx2_fma():
        qgemm_unavailable = "the CPU is not x86-64 with AVX2, FMA and F16C"
        return None
    cc = _compiler()
    if cc is None:
        qgemm_unavailable = "no C compiler (cc/gcc, or $CC) found"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError) as exc:
        qgemm_unavailable = f"building the kernel failed: {exc}"
        log.warning("native quantised GEMM unavailable, using float weights: %s", exc)
        return None
    fn = lib.iterserve_qgemm
    p, i64 = ctypes.c_void_p, ctypes.c_long
    fn.argtypes = [ctypes.c_int, p, i64, i64, p, p, p, p, i64, ctypes.c_int]
    fn.restype = None
    qgemm_unavailable = None
    return fn
