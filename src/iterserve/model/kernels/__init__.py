"""Native CPU kernels: C sources compiled on first use with the system C compiler, loaded by ctypes.

Kernels for where a CPU step spends its time, all over weights in their GGUF encoding (rows of
blocks exactly as in the file; type ids are `gguf.GGMLQuantizationType` values):
- `qgemm.c` / `dequant.c` / `blocks512.h`: `qgemm` (decode GEMM over encoded weights:
  AVX2 and AVX-512 register kernels for Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K /
  F16 / BF16 / F32, a decode-into-L1 kernel for every other type `dequant` covers) and `dequant` (rows -> float32, bit-exact with gguf-py: F32, F16, BF16, Q4_0,
  Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS) for tiles, prefill panels and
  embedding rows;
- `prefill.c`: `gemm`, the GEMM for many rows (prefill chunks, large batches) over every type
  `dequant` covers: weight panels decoded into an L1 scratch, register-blocked float32
  micro-kernels (AVX-512 or AVX2, `gemm_isa`);
- `prefill8.c`: `gemm_int8`, the same GEMM with activations quantised to 8 bits once per call
  and integer dot products (AVX-512 VNNI / AVX2 maddubs) for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0
  / Q4_K / Q5_K / Q6_K; `gemm` runs it under `--kernel-activations int8` and `auto`;
- `decode_attention.c`: attention for one query per sequence read straight from the paged
  KV pool (model/attention.py);
- `prefill_attention.c` (+ `prefill_attention_impl.h`, its body for AVX2 and AVX-512):
  causal attention of prefill chunks (with or without cached context) from the paged KV
  pool, flash-style, float32 / f16 / bf16 pools (model/attention.py);
- `elementwise.c`: RMSNorm, SiLU x up, RoPE and Qwen3's q/k norm in one call each;
- `decode_layers.c`: all decoder layers of a small decode-only step in one call
  (`DecodeLayers`, used by llama.py's fused decode).

One ABI: `iterserve.h` declares every function and struct once and every source includes it;
this module declares the same once (`_ARGTYPES`, `Segment` / `Linear` / `Layer`) and refuses a
library whose self-description (`iterserve_abi`: struct sizes and offsets, the per-type block
table) differs. Every kernel has one checked wrapper below: dtype, device, contiguity, shapes
and strides are checked and a ValueError raised before any pointer is passed; indices the C
code reads (block tables, slots, lengths) are range-checked in C, which returns an error code
that becomes a ValueError. No caller passes a raw `data_ptr()`.

Every `*.c` here goes into one shared object. Building takes a few seconds with gcc; the library
is cached under `$ITERSERVE_CACHE_DIR` (default `~/.cache/iterserve/kernels`) keyed by a hash of
the sources, the headers, the flags and the compiler, so a changed source never loads a stale
build. It links OpenMP by soname (`libgomp.so.1`); torch's wheel ships a `libgomp.so.1` and
loads it first, so the dynamic loader reuses torch's runtime (one thread pool, not two pools
spinning against each other on few cores). ctypes releases the GIL for the call.

Everything degrades, never fails: no x86-64 CPU with AVX2 + FMA + F16C, no compiler, a failed
build, an ABI mismatch or `ITERSERVE_NATIVE_KERNELS=0` make `available()` False (the reason in
`unavailable`); the wrappers then raise `KernelsUnavailable` and callers keep their torch path.
CPU features are detected at run time (`features()`) and logged once when the library loads.
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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCES = sorted(_DIR.glob("*.c"))
_HEADERS = sorted(_DIR.glob("*.h"))
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off",
          "-shared", "-fPIC", "-Wall")
_REQUIRED = frozenset({"avx2", "fma", "f16c"})
ABI_VERSION = 3                      # iterserve.h's ITERSERVE_ABI_VERSION

unavailable: str | None = None       # why the kernels are not in use, for logs and benchmarks


class KernelsUnavailable(RuntimeError):
    """A wrapper was called while `available()` is False (see `unavailable`)."""


# --- the ABI, once -------------------------------------------------------------------------

class Segment(ctypes.Structure):
    """iterserve.h's iterserve_segment: one row segment of an encoded weight."""
    _fields_ = [("type", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("row_bytes", ctypes.c_int64), ("row_stride", ctypes.c_int64),
                ("data", ctypes.c_void_p)]


MAX_SEGMENTS = 3


class Linear(ctypes.Structure):
    """iterserve.h's iterserve_linear: a weight as 1-3 row segments stacked in output order."""
    _fields_ = [("nseg", ctypes.c_int64), ("k", ctypes.c_int64),
                ("seg", Segment * MAX_SEGMENTS)]


class Layer(ctypes.Structure):
    """iterserve.h's iterserve_layer: one decoder layer for iterserve_decode_layers."""
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p),
                ("qkv_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p),
                ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear)]


_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# name -> (restype, argtypes), exactly as iterserve.h declares them
_ARGTYPES = {
    "iterserve_abi": (_i64, [_p, _i64]),
    "iterserve_cpu_features": (_i64, []),
    "iterserve_qgemm": (None, [_i64, _p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64, _i32]),
    "iterserve_dequant": (None, [_i64, _p, _i64, _i64, _i64, _p, _i64, _i32]),
    "iterserve_gemm": (_i32, [_i64, _p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64, _i32]),
    "iterserve_gemm_isa": (_i64, [_i64]),
    "iterserve_qgemm_act8": (_i32, [_i64, _p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64, _i32]),
    "iterserve_act8_isa": (_i64, [_i64]),
    "iterserve_act8_variant": (_i64, [_i64]),
    "iterserve_act8_kq_variant": (_i64, [_i64]),
    "iterserve_act8_kq_gemm_rows": (_i64, [_i64]),
    "iterserve_act8_q32_gemm_rows": (_i64, [_i64]),
    "iterserve_act8_kq_tile": (_i64, [_i64]),
    "iterserve_act8_kq_decode": (_i64, [_i64]),
    "iterserve_set_act_mode": (_i64, [_i64]),
    "iterserve_can_act8": (_i32, [_i64]),
    "iterserve_gemm8": (_i32, [_i64, _p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64, _i32]),
    "iterserve_can_gemm8": (_i32, [_i64]),
    "iterserve_gemm8_pack_variant": (_i64, [_i64]),
    "iterserve_bf16_gemm": (_i32, [_i64, _i64, _p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64,
                                   _i32]),
    "iterserve_bf16_isa": (_i64, [_i64]),
    "iterserve_bf16_takes": (_i32, [_i64, _i64]),
    "iterserve_bf16_variant": (_i64, [_i64]),
    "iterserve_f16_gemm": (_i32, [_i64, _i64, _p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64,
                                  _i32]),
    "iterserve_f16_variant": (_i64, [_i64]),
    "iterserve_f16_takes": (_i32, [_i64, _i64]),
    "iterserve_rmsnorm": (None, [_p, _p, _p, _i64, _i64, _f32]),
    "iterserve_silu_mul": (None, [_p, _p, _i64, _i64]),
    "iterserve_rope": (None, [_p, _i64, _i64, _i64, _i64, _p, _p]),
    "iterserve_qk_norm": (None, [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _f32]),
    "iterserve_decode_attention": (_i32, [_p, _p, _p, _i64, _p, _i32, _p, _i32, _i32, _i32,
                                          _i32, _i32, _i32, _f32, _p, _i32]),
    "iterserve_decode_layers": (_i32, [_p, _i32, _p, _p, _i64, _p, _i64, _i64, _i32, _i32,
                                       _i32, _i64, _f32, _p, _p, _p, _p, _i32, _p, _i32, _i32,
                                       _f32, _i32]),
    # float32 or f16 KV pools (kv_type 0 / 1): the two above with a pool element type
    "iterserve_decode_attention_kv": (_i32, [_p, _p, _p, _i64, _p, _i32, _p, _i32, _i32, _i32,
                                             _i32, _i32, _i32, _f32, _p, _i32, _i32]),
    "iterserve_decode_layers_kv": (_i32, [_p, _i32, _p, _p, _i64, _p, _i64, _i64, _i32, _i32,
                                          _i32, _i64, _f32, _p, _p, _p, _p, _i32, _p, _i32, _i32,
                                          _f32, _i32, _i32]),
    # prefill chunks over the pool (prefill_attention.c): float32 / f16 / bf16 pools
    "iterserve_prefill_attention": (_i32, [_p, _p, _p, _i64, _i32, _p, _p, _p, _p, _i32, _i32,
                                           _i32, _i32, _i32, _i32, _f32, _p, _i32, _i32, _i32]),
    "iterserve_prefill_attention_isa": (_i64, [_i64, _i64]),
}
_ERRORS = {1: "a block table entry lies outside the KV pool",
           2: "a slot lies outside the KV pool",
           3: "a context length is < 1 or longer than its block table",
           4: "unsupported type", 5: "out of memory"}
_FEATURE_BITS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni",
                 "avx512bf16", "avxvnni")
_CPUINFO_NAMES = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f",
                  "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512_vnni": "avx512vnni",
                  "avx512_bf16": "avx512bf16", "avx_vnni": "avxvnni"}


@dataclass(frozen=True)
class TypeCaps:
    block_elems: int
    block_bytes: int
    qgemm: bool
    dequant: bool


def _abi_expected() -> list[int]:
    o = ctypes.sizeof
    S, L, Y = Segment, Linear, Layer
    return [ABI_VERSION, o(S), S.type.offset, S.rows.offset, S.row_bytes.offset,
            S.row_stride.offset, S.data.offset, o(L), L.nseg.offset, L.k.offset, L.seg.offset,
            MAX_SEGMENTS, o(Y), Y.ln1.offset, Y.ln2.offset, Y.qkv_bias.offset,
            Y.q_norm.offset, Y.k_norm.offset, Y.qkv.offset, Y.o.offset, Y.gate_up.offset,
            Y.down.offset]


def _check_abi(lib: ctypes.CDLL) -> dict[int, TypeCaps]:
    """Compare the library's self-description with ctypes' and gguf's; the type table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = (ctypes.c_int64 * 512)()
    n = lib.iterserve_abi(buf, 512)
    got = list(buf[:n])
    want = _abi_expected()
    if got[:len(want)] != want:
        raise RuntimeError(f"kernel ABI mismatch: library {got[:len(want)]}, ctypes {want}")
    limit, rest = got[len(want)], got[len(want) + 1:]
    caps = {}
    for t in range(limit):
        elems, nbytes, qg, dq = rest[4 * t:4 * t + 4]
        if not dq:
            continue
        ref = GGML_QUANT_SIZES.get(GGMLQuantizationType(t))
        if ref != (elems, nbytes):
            raise RuntimeError(f"type {t}: kernel block {(elems, nbytes)}, gguf {ref}")
        caps[t] = TypeCaps(elems, nbytes, bool(qg), bool(dq))
    return caps


# --- building and loading ----------------------------------------------------------------

def cache_dir() -> Path:
    root = os.environ.get("ITERSERVE_CACHE_DIR")
    if root:
        return Path(root) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
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
                    return frozenset(v for k, v in _CPUINFO_NAMES.items() if k in flags)
    except OSError:
        pass
    return frozenset()


def _cpu_has_avx2_fma() -> bool:
    """Whether this CPU can run the kernels at all (AVX2, FMA and F16C), before building."""
    return _REQUIRED <= _cpuinfo_features()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


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
    if os.environ.get("ITERSERVE_NATIVE_KERNELS", "1").lower() in ("0", "false", "no", "off"):
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
        for name, (res, args) in _ARGTYPES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        caps = _check_abi(lib)
    except (OSError, RuntimeError, AttributeError, ValueError) as exc:
        unavailable = f"building or loading the kernels failed: {exc}"
        log.warning("native CPU kernels unavailable, using torch ops: %s", exc)
        return None
    kq_env = os.environ.get("ITERSERVE_KQ_DECODE", "").lower()
    # dlopen hands back the same library (and its static state) on a reload: set the K-quant
    # decode kernels every time
    # ITERSERVE_KQ_DECODE=s15 (A/B only, "s15=ITERSERVE_KQ_DECODE=s15"): session 15's K-quant
    # decode kernels (row tiles that decode a super-block once per tile, dotk_vnni for one
    # row) instead of qdot8.c's dotkv / dotkw / dotk1 kernels, and session 15's hand-over
    # rows (qdot8.c KQ15_GEMM8_ROWS_*); all else as now
    lib.iterserve_act8_kq_decode(1 if kq_env in ("s14", "s15") else 0)
    if kq_env == "s14":
        # A/B only (benchmarks/run_models.py --iterserve-variants "s14=ITERSERVE_KQ_DECODE=s14"):
        # the K-quant decode path as session 14 left it (qdot8.c: 16 KB K chunks, 4-row
        # tiles, no hand-over of many-row steps to the int8 prefill GEMM)
        lib.iterserve_act8_kq_variant(1)
        lib.iterserve_act8_kq_tile(4)
        lib.iterserve_act8_kq_gemm_rows(33)
    kq_rows = os.environ.get("ITERSERVE_KQ_GEMM_ROWS", "")
    if kq_rows.isdigit() and 1 <= int(kq_rows) <= 33:
        # A/B only (run_models.py --iterserve-variants "kq13=ITERSERVE_KQ_GEMM_ROWS=13"): every
        # K-quant decode step of at least this many rows goes to the int8 prefill GEMM (33:
        # none), instead of qdot8.c's measured rows by type and K (KQ_GEMM8_ROWS_*)
        lib.iterserve_act8_kq_gemm_rows(int(kq_rows))
    elif kq_env != "s14":
        lib.iterserve_act8_kq_gemm_rows(0)
    if os.environ.get("ITERSERVE_Q32_DECODE", "").lower() == "s15":
        # A/B only (run_models.py --iterserve-variants "s15=ITERSERVE_Q32_DECODE=s15"): decode
        # steps of the 32-element types as session 15 left them (no hand-over to the int8
        # prefill GEMM up to 32 rows; qdot8.c Q32_GEMM8_ROWS_*) and its one-block panel decode
        lib.iterserve_act8_q32_gemm_rows(33)
        lib.iterserve_gemm8_pack_variant(1)
    bits = lib.iterserve_cpu_features()
    _lib_features = frozenset(n for i, n in enumerate(_FEATURE_BITS) if bits >> i & 1)
    _caps = caps
    unavailable = None
    names = _type_names()
    isa = {1: "avx2", 2: "avx512"}.get(int(lib.iterserve_gemm_isa(0)), "?")
    log.info("native CPU kernels loaded; CPU features: %s; GEMM kernels: %s; qgemm types: %s; "
             "dequant types: %s", " ".join(sorted(_lib_features)) or "none", isa,
             " ".join(names.get(t, str(t)) for t, c in sorted(caps.items()) if c.qgemm),
             " ".join(names.get(t, str(t)) for t, c in sorted(caps.items()) if c.dequant))
    return lib


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


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of k elements of the type (k must be a multiple of its block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]
    if k <= 0 or k % elems:
        raise ValueError(f"row length {k} is not a positive multiple of the "
                         f"{GGMLQuantizationType(int(ggml_type)).name} block ({elems})")
    return k // elems * nbytes


# --- argument checks ---------------------------------------------------------------------

def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise KernelsUnavailable(unavailable or "native kernels unavailable")
    return lib


def _f32(t, name: str, dims: int | None = None, contiguous: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.dtype != torch.float32 or not t.is_cpu:
        raise ValueError(f"{name} must be float32 on the CPU, not {t.dtype} on {t.device}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, not of shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _rows(t: torch.Tensor, name: str) -> int:
    """Row stride (elements) of a 2-D tensor whose rows are contiguous."""
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, not of shape {tuple(t.shape)}")
    rows, cols = t.shape
    s0, s1 = t.stride()
    if cols > 1 and s1 != 1:
        raise ValueError(f"{name} must have contiguous rows (shape {tuple(t.shape)}, "
                         f"strides {(s0, s1)})")
    ld = s0 if rows > 1 else cols
    if ld < cols:
        raise ValueError(f"{name} rows overlap (row stride {ld} < {t.shape[1]})")
    return ld


def _weight(ggml_type: int, w, k: int, what: str) -> tuple[int, int]:
    """Check an encoded weight uint8 [n, row_bytes]; returns (n, row stride in bytes)."""
    caps = _caps.get(ggml_type)
    if caps is None or not getattr(caps, what):
        raise ValueError(f"ggml type {ggml_type} has no native {what}")
    if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8 or not w.is_cpu:
        raise ValueError("weight must be a uint8 CPU tensor of GGUF blocks")
    if not isinstance(k, int) or k <= 0 or k % caps.block_elems:
        raise ValueError(f"k must be a positive multiple of the type's block "
                         f"({caps.block_elems}), not {k!r}")
    ld = _rows(w, "weight")
    rb = k // caps.block_elems * caps.block_bytes
    if w.shape[1] != rb:
        raise ValueError(f"weight rows are {w.shape[1]} bytes; {k} elements of type "
                         f"{ggml_type} take {rb}")
    return w.shape[0], ld


def _threads() -> int:
    return torch.get_num_threads()


# --- the kernels -------------------------------------------------------------------------

def _gemm_args(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
               col0: int, name: str, cap: str) -> tuple | None:
    """The checked C arguments of `qgemm` / `gemm` (None: x has no rows, nothing to do)."""
    t = int(ggml_type)
    n, ldw = _weight(t, w, k, cap)
    if _caps[t].block_elems == 1 and k % 32:
        raise ValueError(f"{name} over float weights needs k % 32 == 0, not {k}")
    _f32(x, "x", 2, contiguous=False)
    _f32(out, "out", 2, contiguous=False)
    ldx, ldo = _rows(x, "x"), _rows(out, "out")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {k}")
    if not isinstance(col0, int) or col0 < 0 or out.shape[1] < col0 + n or out.shape[0] != x.shape[0]:
        raise ValueError(f"out of shape {tuple(out.shape)} cannot take [{x.shape[0]}, {n}] at "
                         f"column {col0}")
    if x.shape[0] == 0:
        return None
    return (t, w.data_ptr(), n, ldw, k, x.data_ptr(), x.shape[0], ldx,
            out.data_ptr() + 4 * col0, ldo, _threads())


def qgemm(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
          col0: int = 0) -> None:
    """out[:, col0:col0+N] = x @ W^T for an encoded weight W (uint8 [N, row_bytes], GGUF
    blocks of `ggml_type`, k elements per row), x float32 [M, k] with contiguous rows, out
    float32 2-D [M, >= col0 + N] with contiguous rows (its row stride may exceed N)."""
    lib = _lib()
    args = _gemm_args(ggml_type, w, k, x, out, col0, "qgemm", "qgemm")
    if args is not None:
        lib.iterserve_qgemm(*args)


def gemm(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
         col0: int = 0) -> None:
    """The prefill / large-batch GEMM (prefill.c): out[:, col0:col0+N] = x @ W^T like `qgemm`,
    for any type `dequant` decodes (float types need k % 32 == 0), with weight panels decoded
    into an L1 scratch and a register-blocked float32 micro-kernel: the decode cost is shared
    by all rows of x, so use it for many rows (layers.QUANT_MAX_ROWS and up)."""
    lib = _lib()
    args = _gemm_args(ggml_type, w, k, x, out, col0, "gemm", "dequant")
    if args is not None:
        _rc(lib.iterserve_gemm(*args))


_ISAS = {"avx2": 1, "avx512": 2}


def gemm_isa(want: str | None = None) -> str:
    """Choose the instruction set of `gemm` and of qgemm's register kernels
    ("avx2", "avx512"; None: the best this CPU has;
    more than it has falls back to the best) and return the one in use. Tests use it to run
    the AVX2 micro-kernel on an AVX-512 CPU."""
    lib = _lib()
    got = lib.iterserve_gemm_isa(_ISAS.get(want or "", 0))
    return {v: k for k, v in _ISAS.items()}[int(got)]


_PATHS = {"auto": 0, "registers": 1, "generic": 2, "panel": 3}


def qgemm_path(path: str, ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor,
               out: torch.Tensor, col0: int = 0) -> None:
    """`qgemm` through one of its paths (tests and benchmarks): "registers" (the type's
    register kernel for the ISA in use, at any row count), "generic" (the decode-into-L1
    kernel), "panel" (the prefill GEMM), "auto" (what `qgemm` does)."""
    lib = _lib()
    fn = lib.iterserve_qgemm_path
    fn.restype, fn.argtypes = None, [_i64, *_ARGTYPES["iterserve_qgemm"][1]]
    args = _gemm_args(ggml_type, w, k, x, out, col0, "qgemm_path", "qgemm")
    if args is not None:
        fn(_PATHS[path], *args)


# --- 8-bit activations (qdot8.c) ------------------------------------------------------------

ACTIVATION_MODES = {"float": 0, "int8": 1, "auto": 2}


def set_activations(mode: str) -> str:
    """How `qgemm` (and with it the fused decode layers) treats activations: "float" (every
    weight block expanded to float32, results equal a float GEMM up to summation order),
    "int8" (rows quantised to 8 bits once per call and dotted in integers, as llama.cpp does,
    for the types `supports_int8` names, up to 32 rows; other calls stay float) or "auto"
    (int8 up to the row counts where qdot8.c measured it faster, and decode steps of many rows
    on the int8 prefill GEMM from the rows measured per type and K: qdot8.c KQ_GEMM8_ROWS_*,
    Q32_GEMM8_ROWS_*). The same mode routes `gemm` (prefill chunks): "int8"
    and "auto" (from 33 rows) run the int8-activation prefill GEMM (prefill8.c) for the types
    `supports_gemm_int8` names. Process-wide; returns the mode now in use."""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATION_MODES)}, not {mode!r}")
    got = _lib().iterserve_set_act_mode(ACTIVATION_MODES[mode])
    return {v: k for k, v in ACTIVATION_MODES.items()}[int(got)]


def configure_activations(choice: str = "auto") -> str:
    """The engine's `--kernel-activations` knob (core/config.py KernelConfig), applied when a
    model loads: "float", "int8" or "auto" (the measured default: see `set_activations` and
    qdot8.c). Without the native library every call runs torch's float path, so the mode is
    "float" whatever the choice. Returns the mode now in use."""
    if choice not in ACTIVATION_MODES:
        raise ValueError(f"kernel activations must be auto, float or int8, not {choice!r}")
    if not available():
        if choice == "int8":
            log.warning("--kernel-activations int8: native kernels unavailable (%s); float",
                        unavailable)
        return "float"
    mode = set_activations(choice)
    log.info("decode GEMM activations: %s (%s; int8 kernels: %s)", mode, choice, int8_isa())
    return mode


def activations() -> str:
    """The activation mode in use ("float", "int8" or "auto"; "float" without the library)."""
    lib = _library()
    if lib is None:
        return "float"
    return {v: k for k, v in ACTIVATION_MODES.items()}[int(lib.iterserve_set_act_mode(-1))]


def supports_int8(ggml_type: int) -> bool:
    """Whether qdot8.c has an int8-activation kernel for the type."""
    lib = _library()
    return bool(lib is not None and lib.iterserve_can_act8(int(ggml_type)))


_ISAS8 = {"avx2": 1, "avx512vnni": 2}


def int8_isa(want: str | None = None) -> str:
    """Choose the instruction set of the int8 kernels ("avx2", "avx512vnni"; None: the best
    this CPU has; more than it has falls back to the best) and return the one in use."""
    got = _lib().iterserve_act8_isa(_ISAS8.get(want or "", 0))
    return {v: k for k, v in _ISAS8.items()}[int(got)]


def qgemm_int8(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
               col0: int = 0) -> None:
    """`qgemm` on the int8-activation kernels whatever the mode (tests, benchmarks): x is
    quantised to 8 bits per block (32 elements for Q4_0 / Q8_0, 256 for Q4_K / Q6_K) and
    dotted in integers; any number of rows."""
    lib = _lib()
    if not supports_int8(ggml_type):
        raise ValueError(f"ggml type {ggml_type} has no int8-activation kernel")
    args = _gemm_args(ggml_type, w, k, x, out, col0, "qgemm_int8", "qgemm")
    if args is not None:
        _rc(lib.iterserve_qgemm_act8(*args))


def supports_gemm_int8(ggml_type: int) -> bool:
    """Whether prefill8.c has an int8-activation prefill GEMM for the type (on this CPU: the
    AVX2 variant has no Q8_0)."""
    lib = _library()
    if lib is None or not lib.iterserve_can_gemm8(int(ggml_type)):
        return False
    return int(ggml_type) != 8 or lib.iterserve_act8_isa(-1) == 2


def gemm_int8(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
              col0: int = 0) -> None:
    """`gemm` on the int8-activation prefill GEMM (prefill8.c) whatever the activation mode
    (tests, benchmarks): x quantised to 8 bits in blocks of 32, weight panels decoded to int8
    codes, integer dot products (AVX-512 VNNI or AVX2, `int8_isa`)."""
    lib = _lib()
    if not supports_gemm_int8(ggml_type):
        raise ValueError(f"ggml type {ggml_type} has no int8 prefill GEMM here")
    args = _gemm_args(ggml_type, w, k, x, out, col0, "gemm_int8", "qgemm")
    if args is not None:
        _rc(lib.iterserve_gemm8(*args))


# --- bf16 dot products for BF16 / F16 weights (bf16dot.c) --------------------------------

_ISASBF16 = {"none": 0, "avx512bf16": 1}
_BF16_PATHS = {"auto": 0, "decode": 1, "panel": 2, "decode_nosplit": 3, "stream": 4}
_BF16_VARIANTS = {"streamed": 0, "chunked": 1}


def bf16_isa(want: str | None = None) -> str:
    """Choose whether the bf16 dot-product kernels may run ("none" switches them off,
    "avx512bf16" or None: on where the CPU has avx512bf16) and return the state in use. In
    the `auto` activation mode BF16 weights take them (see `set_activations`)."""
    got = _lib().iterserve_bf16_isa(-2 if want in (None, "avx512bf16") else _ISASBF16[want])
    return {v: k for k, v in _ISASBF16.items()}[int(got)]


def bf16_variant(want: str | None = None) -> str:
    """The decode kernel (rows below the panel GEMM's) that the auto path runs for BF16
    weights: "streamed" (default: whole weight rows, the next tile prefetched) or "chunked"
    (session 14's, K chunks; ITERSERVE_BF16_DECODE=chunked at start), for same-process A/B
    runs; None only reports. Process-wide, like the activation mode."""
    got = _lib().iterserve_bf16_variant(-1 if want is None else _BF16_VARIANTS[want])
    return {v: k for k, v in _BF16_VARIANTS.items()}[int(got)]


def bf16_takes(ggml_type: int, rows: int) -> bool:
    """Whether `qgemm` / `gemm` run a call of this type and row count on the bf16 kernels."""
    lib = _library()
    return bool(lib is not None and lib.iterserve_bf16_takes(int(ggml_type), int(rows)))


def qgemm_bf16(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
               col0: int = 0, path: str = "auto") -> None:
    """`qgemm` on the bf16 dot-product kernels whatever the mode (tests, benchmarks): BF16 or
    F16 weights, x rounded to bf16 once per call, vdpbf16ps into float32 sums. path: "stream"
    (the streamed decode kernel), "decode" (session 14's decode kernel, K chunks),
    "decode_nosplit" (the same without K chunks), "panel" (the prefill GEMM) or "auto" (by row
    count and `bf16_variant`). Raises
    ValueError where the CPU has no avx512bf16 (bf16_isa() == "none")."""
    lib = _lib()
    if int(ggml_type) not in (1, 30):
        raise ValueError(f"ggml type {ggml_type} has no bf16 dot-product kernel (F16 or BF16)")
    args = _gemm_args(ggml_type, w, k, x, out, col0, "qgemm_bf16", "qgemm")
    if args is not None:
        rc = lib.iterserve_bf16_gemm(_BF16_PATHS[path], *args)
        if rc == 4:
            raise ValueError("the bf16 dot-product kernels are not available on this CPU")
        _rc(rc)


# --- streamed decode kernels for F16 weights (f16dot.c) ------------------------------------

_F16_PATHS = {"auto": 0, "avx2": 1, "avx512": 2}
_F16_VARIANTS = {"streamed": 0, "s15": 1}


def f16_variant(want: str | None = None) -> str:
    """What `qgemm` runs for F16 decode steps (up to f16dot.c's F16_STREAM_ROWS rows):
    "streamed" (default: f16dot.c, whole weight rows, the next group prefetched, exact float32)
    or "s15" (session 15's paths: the register kernel at 1-2 rows, the panel GEMMs from 3;
    ITERSERVE_F16_DECODE=s15 at start), for same-process A/B runs; None only reports.
    Process-wide, like the activation mode."""
    got = _lib().iterserve_f16_variant(-1 if want is None else _F16_VARIANTS[want])
    return {v: k for k, v in _F16_VARIANTS.items()}[int(got)]


def f16_takes(rows: int) -> bool:
    """Whether `qgemm` runs an F16 call of this row count on the streamed F16 kernels."""
    lib = _library()
    return bool(lib is not None and lib.iterserve_f16_takes(1, int(rows)))


def qgemm_f16(w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor, col0: int = 0,
              isa: str = "auto") -> None:
    """`qgemm` of F16 weights on the streamed kernels at any row count (tests, benchmarks):
    isa "auto" (the one `gemm_isa` says), "avx2" or "avx512" (ValueError where the CPU lacks
    it). Exact float32: equals x @ dequant(W)^T up to summation order."""
    lib = _lib()
    args = _gemm_args(1, w, k, x, out, col0, "qgemm_f16", "qgemm")
    if args is not None:
        rc = lib.iterserve_f16_gemm(_F16_PATHS[isa], *args)
        if rc == 4:
            raise ValueError(f"the {isa} F16 kernel is not available on this CPU")
        _rc(rc)


def dequant(ggml_type, w, k, out) -> torch.Tensor:
    """out[n, k] (float32, contiguous rows) = the encoded rows w (uint8 [n, row_bytes]) as
    float32, bit-identical to gguf-py's dequantize; returns out."""
    lib = _lib()
    t = int(ggml_type)
    n, ldw = _weight(t, w, k, "dequant")
    _f32(out, "out", 2, contiguous=False)
    ldo = _rows(out, "out")
    if tuple(out.shape) != (n, k):
        raise ValueError(f"out has shape {tuple(out.shape)}, the rows need {(n, k)}")
    if n:
        lib.iterserve_dequant(t, w.data_ptr(), n, ldw, k, out.data_ptr(), ldo, _threads())
    return out


def rmsnorm(x, w, eps: float, out) -> torch.Tensor:
    """out = x / sqrt(mean(x^2, -1) + eps) * w (HF's order of the products); x, out float32
    contiguous of one shape [..., D], w float32 [D]; out may be x. Returns out."""
    lib = _lib()
    _f32(x, "x")
    _f32(w, "w", 1)
    _f32(out, "out")
    if x.dim() < 1 or w.shape[0] != x.shape[-1] or out.shape != x.shape:
        raise ValueError(f"rmsnorm of {tuple(x.shape)} with weight {tuple(w.shape)} into "
                         f"{tuple(out.shape)}")
    d = x.shape[-1]
    if x.numel():
        lib.iterserve_rmsnorm(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // d, d, eps)
    return out


def silu_mul(gu, out) -> torch.Tensor:
    """out[T, I] = silu(gu[:, :I]) * gu[:, I:] for gu float32 [T, 2I] (both contiguous)."""
    lib = _lib()
    _f32(gu, "gu", 2)
    _f32(out, "out", 2)
    if gu.shape[1] % 2 or tuple(out.shape) != (gu.shape[0], gu.shape[1] // 2):
        raise ValueError(f"silu_mul of {tuple(gu.shape)} into {tuple(out.shape)}")
    lib.iterserve_silu_mul(gu.data_ptr(), out.data_ptr(), gu.shape[0], out.shape[1])
    return out


def _cos_sin(cos, sin, T: int, d: int) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        _f32(t, name)
        if t.numel() != T * d or t.shape[-1] != d:
            raise ValueError(f"{name} of shape {tuple(t.shape)} is not [{T}, {d}]")


def rope(qkv, num_heads_total: int, head_dim: int, cos, sin) -> torch.Tensor:
    """RoPE (HF rotate_half) in place on the leading num_heads_total heads of head_dim floats
    of each row of qkv (float32 2-D, contiguous rows, any row stride); cos/sin float32
    contiguous [T, head_dim] (or [T, 1, head_dim]). Returns qkv."""
    lib = _lib()
    _f32(qkv, "qkv", 2, contiguous=False)
    ld = _rows(qkv, "qkv")
    T = qkv.shape[0]
    if head_dim <= 0 or head_dim % 2 or num_heads_total <= 0 \
            or num_heads_total * head_dim > qkv.shape[1]:
        raise ValueError(f"{num_heads_total} heads of {head_dim} do not fit rows of "
                         f"{qkv.shape[1]}")
    _cos_sin(cos, sin, T, head_dim)
    lib.iterserve_rope(qkv.data_ptr(), T, ld, num_heads_total, head_dim, cos.data_ptr(),
                       sin.data_ptr())
    return qkv


def qk_norm(qkv, num_heads: int, num_kv_heads: int, head_dim: int, q_w, k_w,
            eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm in place: the first num_heads heads of each qkv row with q_w,
    the num_kv_heads heads after them with k_w (float32 [head_dim] each). Returns qkv."""
    lib = _lib()
    _f32(qkv, "qkv", 2, contiguous=False)
    ld = _rows(qkv, "qkv")
    _f32(q_w, "q_w", 1)
    _f32(k_w, "k_w", 1)
    if q_w.shape[0] != head_dim or k_w.shape[0] != head_dim or num_heads <= 0 \
            or num_kv_heads <= 0 or (num_heads + num_kv_heads) * head_dim > qkv.shape[1]:
        raise ValueError("qk_norm: heads or norm weights do not match the rows")
    lib.iterserve_qk_norm(qkv.data_ptr(), qkv.shape[0], ld, num_heads, num_kv_heads, head_dim,
                          q_w.data_ptr(), k_w.data_ptr(), eps)
    return qkv


def _tables(tables, lens, D: int) -> None:
    for name, t, dims in (("tables", tables, 2), ("lens", lens, 1)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device.type != "cpu" \
                or t.dim() != dims or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dims}-D int32 CPU tensor")
    if tables.shape[0] != D or lens.shape[0] != D:
        raise ValueError(f"tables {tuple(tables.shape)} / lens {tuple(lens.shape)} are not for "
                         f"{D} sequences")


KV_TYPES = {torch.float32: 0, torch.float16: 1}   # iterserve.h's ITERSERVE_KV_F32 / _F16


PREFILL_KV_TYPES = {**KV_TYPES, torch.bfloat16: 2}   # prefill attention also reads bf16


def _pools(kpool, vpool, d: int, types=KV_TYPES) -> int:
    """KV heads of a (kpool, vpool) pair: contiguous [slots, kvh * d] CPU tensors of one
    dtype, float32 or float16 (kv_type(kpool) says which)."""
    for name, t in (("kpool", kpool), ("vpool", vpool)):
        if not isinstance(t, torch.Tensor) or t.dtype not in types or not t.is_cpu \
                or t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 2-D "
                             f"{' or '.join(str(k).removeprefix('torch.') for k in types)} "
                             "CPU tensor")
    if kpool.dtype != vpool.dtype:
        raise ValueError(f"kpool is {kpool.dtype}, vpool {vpool.dtype}")
    if kpool.shape != vpool.shape or kpool.shape[1] % d:
        raise ValueError(f"pools {tuple(kpool.shape)} / {tuple(vpool.shape)} do not hold heads "
                         f"of {d}")
    return kpool.shape[1] // d


def _attention_shapes(q, out, kpool, vpool, types) -> tuple[int, int, int, int]:
    """(rows, query heads, head_dim, KV heads) of an attention call, checked: q and out
    float32 contiguous [rows, H, d] alike, d a multiple of 8, pools of `types` holding
    H / group KV heads."""
    _f32(q, "q", 3)
    _f32(out, "out", 3)
    T, H, d = q.shape
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} is not like q {tuple(q.shape)}")
    if d % 8:
        raise ValueError(f"head_dim {d} is not a multiple of 8")
    kvh = _pools(kpool, vpool, d, types)
    if kvh < 1 or H % kvh:
        raise ValueError(f"{H} query heads cannot share {kvh} KV heads")
    return T, H, d, kvh


def kv_type(pool: torch.Tensor) -> int:
    """The kernels' code for a KV pool's dtype (float32 0, float16 1)."""
    return KV_TYPES[pool.dtype]


def _rc(rc: int) -> None:
    if rc:
        raise ValueError(_ERRORS.get(rc, f"kernel error {rc}"))


def decode_attention(q=None, kpool=None, vpool=None, tables=None, lens=None, window: int = 0,
                     block_size: int = 0, scale: float = 1.0, out=None):
    """Attention of one query per sequence over its context in the paged pool: q, out float32
    contiguous [D, H, d]; kpool/vpool float32 or float16 (both alike) contiguous
    [slots, kvh * d]; tables int32
    [D, max_blocks], lens int32 [D] (context lengths, the new token included); window 0 or a
    sliding window. Returns out.

    Called with no arguments (legacy, runner.py's probe): this function if available, else
    None."""
    if q is None:
        return decode_attention if available() else None
    lib = _lib()
    D, H, d, kvh = _attention_shapes(q, out, kpool, vpool, KV_TYPES)
    _tables(tables, lens, D)
    if block_size <= 0 or window < 0:
        raise ValueError(f"block_size {block_size} / window {window}")
    if D == 0:
        return out
    _rc(lib.iterserve_decode_attention_kv(
        q.data_ptr(), kpool.data_ptr(), vpool.data_ptr(), kpool.shape[0], tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), window, D, H, kvh, d, block_size, scale,
        out.data_ptr(), _threads(), kv_type(kpool)))
    return out


PREFILL_ISAS = {"auto": 0, "avx2": 1, "avx512": 2}


def prefill_attention_isa(d: int, isa: str = "auto") -> str:
    """The vector ISA prefill_attention runs with for head_dim d ("avx2" / "avx512")."""
    got = int(_lib().iterserve_prefill_attention_isa(PREFILL_ISAS[isa], d))
    return {1: "avx2", 2: "avx512"}[got]


class PrefillChunks:
    """A step's prefill chunks for prefill_attention, checked once and reused by every layer.

    Why: the tables, lengths and row ranges are the same in all layers of a step, and their
    checks include tensor reductions (min/max of the rows); made once in
    attention.build_metadata, the per-layer `run` checks only what changes per layer (q, out,
    the pools). q_starts / ctx / qlens int32 [P], tables int32 [P, max_blocks] (contiguous,
    CPU); chunk s has qlens[s] queries at rows q_starts[s].. at positions ctx[s].. (its
    cached context before it); window 0 or a sliding window. The C side checks every table
    entry against the pool and each chunk's length against its table (cheap there)."""

    __slots__ = ("q_starts", "ctx", "qlens", "tables", "window", "block_size", "rows")

    def __init__(self, q_starts, ctx, qlens, tables, window: int, block_size: int) -> None:
        P = tables.shape[0] if isinstance(tables, torch.Tensor) else -1
        _tables(tables, qlens, P)
        for name, t in (("q_starts", q_starts), ("ctx", ctx)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device.type != "cpu" \
                    or tuple(t.shape) != (P,) or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int32 CPU tensor [{P}]")
        if block_size <= 0 or window < 0:
            raise ValueError(f"block_size {block_size} / window {window}")
        if P and int(q_starts.min()) < 0:
            raise ValueError("a chunk's rows lie outside q (a negative start)")
        self.q_starts, self.ctx, self.qlens, self.tables = q_starts, ctx, qlens, tables
        self.window, self.block_size = window, block_size
        # rows of q the chunks reach: q must have at least these
        self.rows = int((q_starts.long() + qlens.long()).max()) if P else 0

    def run(self, q, kpool, vpool, scale: float, out, isa: str = "auto"):
        """Causal attention of the chunks over the paged pool: q, out float32 contiguous
        [T, H, d]; kpool/vpool float32, float16 or bfloat16 (both alike) contiguous
        [slots, kvh * d]. Writes only the chunks' rows of out; returns out."""
        T, H, d, kvh = _attention_shapes(q, out, kpool, vpool, PREFILL_KV_TYPES)
        P = self.tables.shape[0]
        if P == 0:
            return out
        if self.rows > T:
            raise ValueError(f"a chunk's rows lie outside q's {T} rows")
        _rc(_lib().iterserve_prefill_attention(
            q.data_ptr(), kpool.data_ptr(), vpool.data_ptr(), kpool.shape[0], P,
            self.q_starts.data_ptr(), self.ctx.data_ptr(), self.qlens.data_ptr(),
            self.tables.data_ptr(), self.tables.shape[1], self.window, H, kvh, d,
            self.block_size, scale, out.data_ptr(), _threads(), PREFILL_KV_TYPES[kpool.dtype],
            PREFILL_ISAS[isa]))
        return out


def prefill_attention(q, kpool, vpool, q_starts, ctx, qlens, tables, window: int,
                      block_size: int, scale: float, out, isa: str = "auto"):
    """Causal attention of prefill chunks over the paged pool (prefill_attention.c) in one
    call: `PrefillChunks(q_starts, ctx, qlens, tables, window, block_size).run(q, kpool,
    vpool, scale, out, isa)` (see both). The engine makes the PrefillChunks once per step."""
    return PrefillChunks(q_starts, ctx, qlens, tables, window, block_size).run(
        q, kpool, vpool, scale, out, isa)


# --- all decoder layers of a decode-only step ------------------------------------------------

@dataclass
class LayerSpec:
    """One decoder layer's tensors for DecodeLayers. Each weight is a list of 1-3
    `(ggml_type, w)` row segments stacked in output order (w uint8 [rows, row_bytes] in GGUF
    blocks), e.g. q, k, v of a Q4_K_M file in their own types."""
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: list[tuple[int, torch.Tensor]]
    o: list[tuple[int, torch.Tensor]]
    gate_up: list[tuple[int, torch.Tensor]]
    down: list[tuple[int, torch.Tensor]]
    qkv_bias: torch.Tensor | None = None       # Qwen2
    q_norm: torch.Tensor | None = None         # Qwen3 (with k_norm)
    k_norm: torch.Tensor | None = None


class DecodeLayers:
    """Every decoder layer of a decode-only step in one native call (decode_layers.c), with
    the same kernels, order and arithmetic as the per-module native path, so its results are
    bit-identical to that path. Built once per model; `run` updates h in place."""

    def __init__(self, layers: list[LayerSpec], hidden: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate: int, eps: float) -> None:
        lib = _lib()
        if not layers:
            raise ValueError("no layers")
        if head_dim % 8 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads / {num_kv_heads} KV heads of {head_dim}")
        self.hidden, self.num_heads, self.num_kv_heads = hidden, num_heads, num_kv_heads
        self.head_dim, self.intermediate, self.eps = head_dim, intermediate, eps
        self._fn = lib.iterserve_decode_layers_kv
        self._keep: list[torch.Tensor] = []          # every tensor the structs point into
        qkvw = (num_heads + 2 * num_kv_heads) * head_dim
        self._layers = (Layer * len(layers))()
        for i, spec in enumerate(layers):
            L = self._layers[i]
            L.ln1 = self._vec(spec.ln1, hidden, f"layer {i} ln1")
            L.ln2 = self._vec(spec.ln2, hidden, f"layer {i} ln2")
            L.qkv_bias = None if spec.qkv_bias is None else \
                self._vec(spec.qkv_bias, qkvw, f"layer {i} qkv_bias")
            if (spec.q_norm is None) != (spec.k_norm is None):
                raise ValueError(f"layer {i}: q_norm and k_norm come together")
            L.q_norm = None if spec.q_norm is None else \
                self._vec(spec.q_norm, head_dim, f"layer {i} q_norm")
            L.k_norm = None if spec.k_norm is None else \
                self._vec(spec.k_norm, head_dim, f"layer {i} k_norm")
            self._linear(L.qkv, spec.qkv, qkvw, hidden, f"layer {i} qkv")
            self._linear(L.o, spec.o, hidden, num_heads * head_dim, f"layer {i} o")
            self._linear(L.gate_up, spec.gate_up, 2 * intermediate, hidden, f"layer {i} gate_up")
            self._linear(L.down, spec.down, hidden, intermediate, f"layer {i} down")
        self._pool_key: tuple | None = None
        self._pool_arrays = None

    @staticmethod
    def supported(specs: list[LayerSpec]) -> bool:
        """Whether the native library is available and every segment type has a qgemm."""
        if not available():
            return False
        return all(supports_qgemm(t) for s in specs
                   for segs in (s.qkv, s.o, s.gate_up, s.down) for t, _ in segs)

    def _vec(self, t, n: int, name: str) -> int:
        _f32(t, name, 1)
        if t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} elements, not {n}")
        self._keep.append(t)
        return t.data_ptr()

    def _linear(self, dst: Linear, segments, n: int, k: int, name: str) -> None:
        if not 1 <= len(segments) <= MAX_SEGMENTS:
            raise ValueError(f"{name}: {len(segments)} segments (1-{MAX_SEGMENTS} allowed)")
        dst.nseg, dst.k = len(segments), k
        total = 0
        for j, (t, w) in enumerate(segments):
            t = int(t)
            rows, ld = _weight(t, w, k, "qgemm")
            if _caps[t].block_elems == 1 and k % 32:
                raise ValueError(f"{name}: float weights need k % 32 == 0")
            dst.seg[j] = Segment(t, rows, w.shape[1], ld, w.data_ptr())
            self._keep.append(w)
            total += rows
        if total != n:
            raise ValueError(f"{name}: segments have {total} rows, the layer needs {n}")

    def _pool_ptrs(self, k_pools, v_pools, slots: int):
        key = tuple(k_pools) + tuple(v_pools)
        if self._pool_key is not None and len(key) == len(self._pool_key) \
                and all(a is b for a, b in zip(key, self._pool_key)):
            return self._pool_arrays
        n = len(self._layers)
        if len(k_pools) != n or len(v_pools) != n:
            raise ValueError(f"{len(k_pools)} / {len(v_pools)} pools for {n} layers")
        kvw = self.num_kv_heads * self.head_dim
        for kp, vp in zip(k_pools, v_pools):
            if _pools(kp, vp, self.head_dim) != self.num_kv_heads or kp.shape[0] != slots \
                    or kp.dtype != k_pools[0].dtype:
                raise ValueError(f"pools must all be [{slots}, {kvw}] of one dtype")
        arrays = ((ctypes.c_void_p * n)(*[p.data_ptr() for p in k_pools]),
                  (ctypes.c_void_p * n)(*[p.data_ptr() for p in v_pools]))
        self._pool_key, self._pool_arrays = key, arrays
        return arrays

    def run(self, h, cos, sin, slot_mapping, tables, lens, window: int, block_size: int,
            scale: float, k_pools, v_pools) -> torch.Tensor:
        """h float32 contiguous [T, hidden] (updated in place and returned) through every
        layer; cos/sin [T, head_dim]; slot_mapping int64 [T] (where each token's K/V goes);
        tables int32 [T, max_blocks], lens int32 [T]; k_pools / v_pools one float32 or float16 (all alike)
        [slots, kv_heads * head_dim] per layer."""
        _f32(h, "h", 2)
        T = h.shape[0]
        if h.shape[1] != self.hidden:
            raise ValueError(f"h has {h.shape[1]} columns, hidden is {self.hidden}")
        _cos_sin(cos, sin, T, self.head_dim)
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64 \
                or slot_mapping.device.type != "cpu" or tuple(slot_mapping.shape) != (T,) \
                or not slot_mapping.is_contiguous():
            raise ValueError(f"slot_mapping must be a contiguous int64 CPU tensor [{T}]")
        _tables(tables, lens, T)
        if block_size <= 0 or window < 0:
            raise ValueError(f"block_size {block_size} / window {window}")
        if not k_pools:
            raise ValueError("no KV pools")
        slots = k_pools[0].shape[0]
        kp, vp = self._pool_ptrs(k_pools, v_pools, slots)
        if T == 0:
            return h
        _rc(self._fn(ctypes.addressof(self._layers), len(self._layers), ctypes.addressof(kp),
                     ctypes.addressof(vp), slots, h.data_ptr(), T,
                     self.hidden, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.intermediate, self.eps, cos.data_ptr(), sin.data_ptr(),
                     slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1],
                     lens.data_ptr(), window, block_size, scale, _threads(),
                     kv_type(k_pools[0])))
        return h
