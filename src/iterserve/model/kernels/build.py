"""Building and loading the kernel library: C sources compiled on first use, cached by a hash.

Every `*.c` next to this file goes into one shared object. Building takes a few seconds with
gcc (each .c on its own core, then one link); the library is cached under
`$ITERSERVE_CACHE_DIR` (default `~/.cache/iterserve/kernels`) keyed by a hash of the sources,
the headers, the flags and the compiler, so a changed source never loads a stale build. It
links OpenMP by soname (`libgomp.so.1`); torch's wheel ships a `libgomp.so.1` and loads it
first, so the dynamic loader reuses torch's runtime (one thread pool, not two pools spinning
against each other on few cores). ctypes releases the GIL for the call.

Everything degrades, never fails: no x86-64 CPU with AVX2 + FMA + F16C, no compiler, a failed
build, an ABI mismatch or `ITERSERVE_NATIVE_KERNELS=0` make `available()` False (the reason in
`unavailable`); the wrappers then raise `KernelsUnavailable` and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from iterserve import envs
from iterserve.errors import KernelsUnavailable
from iterserve.model.kernels._abi import (ARGTYPES, CPUINFO_NAMES, FEATURE_BITS, TypeCaps,
                                          check_abi)

log = logging.getLogger("iterserve.model.kernels")
# Called with the library each time it loads; config.py registers the call that hands the
# library the process's kernel configuration (a list, so build.py needs no import of it).
on_load: list = []

_DIR = Path(__file__).parent
_SOURCES = sorted(_DIR.glob("*.c"))
_HEADERS = sorted(_DIR.glob("*.h"))
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off",
          "-shared", "-fPIC", "-Wall")
_REQUIRED = frozenset({"avx2", "fma", "f16c"})

unavailable: str | None = None       # why the kernels are not in use, for logs and benchmarks


def cache_dir() -> Path:
    root = envs.ITERSERVE_CACHE_DIR
    if root:
        return Path(root) / "kernels"
    base = envs.XDG_CACHE_HOME or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "iterserve" / "kernels"


@functools.cache
def _cpuinfo_features() -> frozenset[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return frozenset(v for k, v in CPUINFO_NAMES.items() if k in flags)
    except OSError:
        pass
    return frozenset()


def _cpu_has_avx2_fma() -> bool:
    """Whether this CPU can run the kernels at all (AVX2, FMA and F16C), before building."""
    return _REQUIRED <= _cpuinfo_features()


def _compiler() -> str | None:
    return envs.CC or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    """Compile the sources (once per sources/flags/compiler); return the cached .so path.

    Each .c is compiled to an object file on its own core, then they are linked: the same
    compilation units and flags as one `cc ... *.c -o lib.so` (the cache key is unchanged),
    but a clean build takes as long as the slowest file (qgemm.c, ~20 s of CPU of the ~30)
    instead of the sum. An exclusive lock on `<key>.lock` next to the output makes
    concurrent processes (test workers, an engine and its rank processes) build a given key
    once: the others wait and load the result. The .so appears atomically (os.replace)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"".join(p.read_bytes() for p in [*_SOURCES, *_HEADERS])
                         + repr(_FLAGS).encode()
                         + version.encode()).hexdigest()[:16]
    out = cache_dir() / f"iterserve-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"iterserve-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)           # released when the file closes
        if out.exists():                           # another process built it meanwhile
            return out
        tmpdir = tempfile.mkdtemp(dir=out.parent, prefix=f".build-{key}-")
        try:
            compile_flags = [f for f in _FLAGS if f != "-shared"]
            objs = [os.path.join(tmpdir, f"{src.stem}.o") for src in _SOURCES]

            def compile_one(src_obj: tuple[Path, str]) -> subprocess.CompletedProcess:
                src, obj = src_obj
                return subprocess.run([cc, *compile_flags, "-c", str(src), "-o", obj],
                                      capture_output=True, text=True)
            workers = max(1, min(len(_SOURCES), len(os.sched_getaffinity(0))
                                 if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                procs = list(pool.map(compile_one, zip(_SOURCES, objs)))
            for src, proc in zip(_SOURCES, procs):
                if proc.returncode != 0:
                    raise RuntimeError(f"{cc} failed on {src.name}: {proc.stderr.strip()[-2000:]}")
            tmp = os.path.join(tmpdir, "lib.so")
            proc = subprocess.run([cc, *_FLAGS, *objs, "-o", tmp], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed to link: {proc.stderr.strip()[-2000:]}")
            os.replace(tmp, out)   # atomic: concurrent processes never load a half-written file
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return out


_caps: dict[int, TypeCaps] = {}
_lib_features: frozenset[str] | None = None


@functools.cache
def _library() -> ctypes.CDLL | None:
    global unavailable, _caps, _lib_features
    _caps, _lib_features = {}, None
    if not envs.ITERSERVE_NATIVE_KERNELS:
        unavailable = "disabled by ITERSERVE_NATIVE_KERNELS"
        return None
    if not _cpu_has_avx2_fma():
        unavailable = "the CPU is not x86-64 with AVX2, FMA and F16C"
        return None
    cc = _compiler()
    if cc is None:
        unavailable = "no C compiler (cc/gcc, or $CC) found"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
        for name, (res, args) in ARGTYPES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        caps = check_abi(lib)
    except (OSError, RuntimeError, AttributeError, ValueError) as exc:
        unavailable = f"building or loading the kernels failed: {exc}"
        log.warning("native CPU kernels unavailable, using torch ops: %s", exc)
        return None
    # dlopen hands back the same library (and its static state) on a reload: configure it
    # every time, with the configuration this process holds (config.py registers its apply)
    for hook in on_load:
        hook(lib)
    bits = lib.iterserve_cpu_features()
    _lib_features = frozenset(n for i, n in enumerate(FEATURE_BITS) if bits >> i & 1)
    _caps = caps
    unavailable = None
    names = _type_names()
    log.info("native CPU kernels loaded; CPU features: %s; GEMM kernels: %s; qgemm types: %s; "
             "dequant types: %s", " ".join(sorted(_lib_features)) or "none",
             {2: "avx512"}.get(state_of(lib)["wide"], "avx2"),
             " ".join(names.get(t, str(t)) for t, c in sorted(caps.items()) if c.qgemm),
             " ".join(names.get(t, str(t)) for t, c in sorted(caps.items()) if c.dequant))
    return lib


def state_of(lib: ctypes.CDLL) -> dict[str, int]:
    """The library's resolved state: activations, features, wide (2: AVX-512 float kernels),
    int8 (2: AVX-512 VNNI int8 kernels), vbmi, bf16, invariant."""
    buf = (ctypes.c_int64 * 8)()
    n = lib.iterserve_config_state(buf, 8)
    return dict(zip(("activations", "features", "wide", "int8", "vbmi", "bf16", "invariant"),
                    buf[:n]))


def _type_names() -> dict[int, str]:
    from gguf import GGMLQuantizationType
    return {int(t): t.name for t in GGMLQuantizationType}


def clear_cache() -> None:
    """Forget the loaded library (tests switch ITERSERVE_NATIVE_KERNELS / the cache dir)."""
    _library.cache_clear()


def available() -> bool:
    """Whether the native kernels are built and usable here (else see `unavailable`)."""
    return _library() is not None


def features() -> set[str]:
    """CPU features detected at run time: avx2, fma, f16c, avx512f, avx512bw, avx512vl,
    avx512vnni, avx512bf16, avxvnni (by cpuid + OS state when the library is loaded, else
    from /proc/cpuinfo)."""
    _library()
    return set(_lib_features if _lib_features is not None else _cpuinfo_features())


def supports_qgemm(ggml_type: int) -> bool:
    _library()
    c = _caps.get(int(ggml_type))
    return bool(c and c.qgemm)


def supports_dequant(ggml_type: int) -> bool:
    _library()
    c = _caps.get(int(ggml_type))
    return bool(c and c.dequant)


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise KernelsUnavailable(unavailable or "native kernels unavailable")
    return lib
