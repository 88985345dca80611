"""Native CPU kernels: C sources compiled on first use with the system C compiler, loaded by ctypes.

Kernels for where a decode step spends its time on CPU:
- `qgemm.c`: GEMM over GGUF-blocked weights (model/quant.py, used by layers.Linear);
- `decode_attention.c`: attention for one query per sequence read straight from the paged
  KV pool (used by model/attention.py);
- `elementwise.c`: RMSNorm, SiLU x up and RoPE in one call each (layers.RMSNorm, llama.MLP,
  llama.Attention), where
  small batches pay more for torch's per-op dispatch than for the arithmetic;
- `decode_layers.c`: all decoder layers of a small decode-only step in one call, chaining
  the kernels above without Python in between (llama.LlamaForCausalLM.use_fused_decode).
Every `*.c` here goes into one shared object. Building takes about two seconds with gcc; the
library is cached under `$ITERSERVE_CACHE_DIR` (default `~/.cache/iterserve/kernels`) keyed
by a hash of the sources, the flags and the compiler, so a changed source never loads a
stale build.

It links OpenMP by soname (`libgomp.so.1`). torch's wheel ships a `libgomp.so.1` and loads it
first, so the dynamic loader reuses torch's runtime: one thread pool, not two pools spinning
against each other on few cores. ctypes releases the GIL for the call, so the server's event
loop keeps running while a step computes.

Everything degrades, never fails: no x86-64 AVX2+FMA CPU, no compiler, a failed build, or
`ITERSERVE_NATIVE_KERNELS=0` make `qgemm()`, `decode_attention()`, `elementwise()` and
`decode_layers()` return None (the reason in `unavailable`), and callers use their torch path.
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

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off",
          "-shared", "-fPIC", "-Wall")

unavailable: str | None = None   # why the kernels are not in use, for logs and benchmarks


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
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    return False


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    """Compile the sources (once per sources/flags/compiler); return the cached .so path."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"".join(p.read_bytes() for p in [*_SOURCES, *_HEADERS])
                         + repr(_FLAGS).encode()
                         + version.encode()).hexdigest()[:16]
    out = cache_dir() / f"iterserve-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, *map(str, _SOURCES), "-o", tmp],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)          # atomic: concurrent processes never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    global unavailable
    import torch  # noqa: F401  - load torch's libgomp first, so the kernels share its pool

    if os.environ.get("ITERSERVE_NATIVE_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        unavailable = "disabled by ITERSERVE_NATIVE_KERNELS"
        return None
    if not _cpu_has_avx2_fma():
        unavailable = "the CPU is not x86-64 with AVX2 and FMA"
        return None
    cc = _compiler()
    if cc is None:
        unavailable = "no C compiler (cc/gcc, or $CC) found"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError) as exc:
        unavailable = f"building the kernels failed: {exc}"
        log.warning("native CPU kernels unavailable, using torch ops: %s", exc)
        return None
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.iterserve_qgemm.argtypes = [i32, p, i64, i64, p, p, p, p, i64, i32]
    lib.iterserve_qgemm.restype = None
    lib.iterserve_decode_attention.argtypes = [p, p, p, p, i32, p, i32, i32, i32, i32, i32, i32,
                                               ctypes.c_float, p, i32]
    lib.iterserve_decode_attention.restype = None
    lib.iterserve_rmsnorm.argtypes = [p, p, p, i64, i64, ctypes.c_float]
    lib.iterserve_rmsnorm.restype = None
    lib.iterserve_silu_mul.argtypes = [p, p, i64, i64]
    lib.iterserve_silu_mul.restype = None
    lib.iterserve_rope.argtypes = [p, i64, i64, i64, i64, p, p]
    lib.iterserve_rope.restype = None
    lib.iterserve_decode_layers.argtypes = [p, i32, p, i64, i64, i32, i32, i32, i64,
                                            ctypes.c_float, p, p, p, p, i32, p, i32, i32,
                                            ctypes.c_float, i32]
    lib.iterserve_decode_layers.restype = None
    unavailable = None
    return lib


def clear_cache() -> None:
    """Forget the loaded library (tests switch ITERSERVE_NATIVE_KERNELS / the cache dir)."""
    _library.cache_clear()


def qgemm():
    """`iterserve_qgemm` (see qgemm.c), or None."""
    lib = _library()
    return None if lib is None else lib.iterserve_qgemm


def elementwise():
    """The library with `iterserve_rmsnorm`, `iterserve_silu_mul` and `iterserve_rope`
    (elementwise.c), or None."""
    return _library()


def decode_layers():
    """`iterserve_decode_layers` (see decode_layers.c), or None."""
    lib = _library()
    return None if lib is None else lib.iterserve_decode_layers


def decode_attention():
    """`iterserve_decode_attention` (see decode_attention.c), or None."""
    lib = _library()
    return None if lib is None else lib.iterserve_decode_attention
