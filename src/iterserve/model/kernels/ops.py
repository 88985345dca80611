"""The checked wrappers: one per kernel, the only way Python reaches the library.

Each wrapper checks dtype, device, contiguity, shapes and strides and raises ValueError
before any pointer is passed; indices the C code reads (block tables, slots, lengths) are
range-checked in C, which returns an error code that becomes a ValueError. No caller passes
a raw `data_ptr()`.
"""

from __future__ import annotations

import torch

from iterserve.model.kernels import build
from iterserve.model.kernels._abi import ERRORS as _ERRORS
from iterserve.model.kernels.build import _lib, _library, available
from iterserve.model.kernels.config import LAYER_ACTIVATION_MODES, state_of


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of k elements of the type (k must be a multiple of its block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]
    if k <= 0 or k % elems:
        raise ValueError(f"row length {k} is not a positive multiple of the "
                         f"{GGMLQuantizationType(int(ggml_type)).name} block ({elems})")
    return k // elems * nbytes


# --- argument checks ---------------------------------------------------------------------

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
    caps = build._caps.get(ggml_type)
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


def linear_struct(dst, segments, n: int, k: int, name: str, keep: list) -> None:
    """Fill an `_abi.Linear` (iterserve_linear) from 1-3 `(ggml_type, w)` row segments of a
    weight [n, k], checking every segment; the tensors it points into go on `keep`."""
    from iterserve.model.kernels._abi import MAX_SEGMENTS, Segment
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"{name}: {len(segments)} segments (1-{MAX_SEGMENTS} allowed)")
    dst.nseg, dst.k = len(segments), k
    total = 0
    for j, (t, w) in enumerate(segments):
        t = int(t)
        rows, ld = _weight(t, w, k, "qgemm")
        if build._caps[t].block_elems == 1 and k % 32:
            raise ValueError(f"{name}: float weights need k % 32 == 0")
        dst.seg[j] = Segment(t, rows, w.shape[1], ld, w.data_ptr())
        keep.append(w)
        total += rows
    if total != n:
        raise ValueError(f"{name}: segments have {total} rows, the layer needs {n}")


# --- the linear kernels (dispatch.c's table and its leaves) -----------------------------------

def _gemm_args(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
               col0: int, name: str, cap: str) -> tuple | None:
    """The checked C arguments of `qgemm` / `gemm` (None: x has no rows, nothing to do)."""
    t = int(ggml_type)
    n, ldw = _weight(t, w, k, cap)
    if build._caps[t].block_elems == 1 and k % 32:
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


def _act(activations: str | None) -> int:
    """iterserve.h's ITERSERVE_ACT_*: a layer's own mode, or -1 (the configured one)."""
    return -1 if activations is None else LAYER_ACTIVATION_MODES[activations]


def qgemm(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
          col0: int = 0, activations: str | None = None) -> None:
    """out[:, col0:col0+N] = x @ W^T for an encoded weight W (uint8 [N, row_bytes], GGUF
    blocks of `ggml_type`, k elements per row), x float32 [M, k] with contiguous rows, out
    float32 2-D [M, >= col0 + N] with contiguous rows (its row stride may exceed N).
    `activations` ("float", "int8", "auto"): this call's mode instead of the configured one."""
    lib = _lib()
    args = _gemm_args(ggml_type, w, k, x, out, col0, "qgemm", "qgemm")
    if args is not None:
        lib.iterserve_qgemm_act(_act(activations), *args)


def gemm(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
         col0: int = 0, activations: str | None = None) -> None:
    """The prefill / large-batch GEMM (prefill.c): out[:, col0:col0+N] = x @ W^T like `qgemm`,
    for any type `dequant` decodes (float types need k % 32 == 0), with weight panels decoded
    into an L1 scratch and a register-blocked float32 micro-kernel: the decode cost is shared
    by all rows of x, so use it for many rows (layers.QUANT_MAX_ROWS and up)."""
    lib = _lib()
    args = _gemm_args(ggml_type, w, k, x, out, col0, "gemm", "dequant")
    if args is not None:
        _rc(lib.iterserve_gemm_act(_act(activations), *args))


_KERNELS = {"auto": 0, "registers": 1, "generic": 2, "panel": 3, "int8": 4, "gemm8": 5,
            "bf16": 6, "f16": 7, "dec8": 8, "split8": 9}         # iterserve.h ITERSERVE_K_*
_KERNEL_NAMES = {v: k for k, v in _KERNELS.items()}


def route(ggml_type: int, rows: int, k: int = 4096, activations: str | None = None) -> str:
    """The kernel dispatch.c's table chooses for `qgemm` of this type, row count and k under
    the configuration in use (`activations`: a call's own mode): "registers", "panel",
    "int8", "gemm8", "bf16" or "f16"."""
    return _KERNEL_NAMES[int(_lib().iterserve_route_act(int(ggml_type), int(rows), int(k),
                                                         _act(activations)))]


def qgemm_path(path: str, ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor,
               out: torch.Tensor, col0: int = 0) -> None:
    """`qgemm` through one kernel of the table (tests and benchmarks): "registers" (the
    type's float register kernel for the ISA in use, at any row count), "generic" (the
    decode-into-L1 kernel), "panel" (the float panel GEMM), "auto" (what `qgemm` does)."""
    _linear_kernel(path, "qgemm_path", ggml_type, w, k, x, out, col0)


def _linear_kernel(kernel: str, caller: str, ggml_type: int, w: torch.Tensor, k: int,
                   x: torch.Tensor, out: torch.Tensor, col0: int) -> None:
    """One kernel of dispatch.c's table (`_KERNELS`) on a checked call, for the functions
    that force one whatever the mode."""
    lib = _lib()
    args = _gemm_args(ggml_type, w, k, x, out, col0, caller, "qgemm")
    if args is not None:
        _rc(lib.iterserve_linear_kernel(_KERNELS[kernel], *args))


def bf16_takes(ggml_type: int, rows: int) -> bool:
    """Whether `qgemm` / `gemm` run a call of this type and row count on the bf16 kernels."""
    return available() and route(ggml_type, rows) == "bf16"


def f16_takes(rows: int) -> bool:
    """Whether `qgemm` runs an F16 call of this row count on f16dot.c's streamed kernels."""
    return available() and route(1, rows) == "f16"


# --- 8-bit activations (qdot8.c, prefill8.c) -----------------------------------------------

def supports_int8(ggml_type: int) -> bool:
    """Whether qdot8.c has an int8-activation kernel for the type."""
    lib = _library()
    return bool(lib is not None and lib.iterserve_can_act8(int(ggml_type)))


def qgemm_int8(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
               col0: int = 0) -> None:
    """`qgemm` on the int8-activation kernels whatever the mode (tests, benchmarks): x is
    quantised to 8 bits per block (32 elements for Q4_0 / Q8_0, 256 for Q4_K / Q6_K) and
    dotted in integers; any number of rows."""
    _lib()                 # the missing library's own error before the type check
    if not supports_int8(ggml_type):
        raise ValueError(f"ggml type {ggml_type} has no int8-activation kernel")
    _linear_kernel("int8", "qgemm_int8", ggml_type, w, k, x, out, col0)


def supports_gemm_int8(ggml_type: int) -> bool:
    """Whether prefill8.c has an int8-activation prefill GEMM for the type (on this CPU: the
    AVX2 variant has no Q8_0)."""
    lib = _library()
    if lib is None or not lib.iterserve_can_gemm8(int(ggml_type)):
        return False
    return int(ggml_type) != 8 or state_of(lib)["int8"] == 2


def gemm_int8(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
              col0: int = 0) -> None:
    """`gemm` on the int8-activation prefill GEMM (prefill8.c) whatever the activation mode
    (tests, benchmarks): x quantised to 8 bits in blocks of 32, weight panels decoded to int8
    codes, integer dot products (AVX-512 VNNI or AVX2, `int8_isa`)."""
    _lib()                 # the missing library's own error before the type check
    if not supports_gemm_int8(ggml_type):
        raise ValueError(f"ggml type {ggml_type} has no int8 prefill GEMM here")
    _linear_kernel("gemm8", "gemm_int8", ggml_type, w, k, x, out, col0)


# --- bf16 dot products for BF16 / F16 weights (bf16dot.c) --------------------------------

_BF16_PATHS = {"auto": 0, "decode": 1, "stream": 1, "panel": 2}


def qgemm_split8(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
                 col0: int = 0) -> None:
    """`qgemm` on split activations whatever the row count (tests, benchmarks): each row of x
    as its 8-bit rounding plus that rounding's residual in 8 bits, two rows of the int8
    kernels summed (qdot8.c iterserve_k_split8): int8 speed, ~1/250 of int8's rounding error.
    What the LM head runs at decode row counts under auto (layers.LM_HEAD_AUTO_ACTIVATIONS)."""
    _lib()                 # the missing library's own error before the type check
    if not supports_int8(ggml_type):
        raise ValueError(f"ggml type {ggml_type} has no int8-activation kernel")
    _linear_kernel("split8", "qgemm_split8", ggml_type, w, k, x, out, col0)


def qgemm_bf16(ggml_type: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
               col0: int = 0, path: str = "auto") -> None:
    """`qgemm` on the bf16 dot-product kernels whatever the mode (tests, benchmarks): BF16 or
    F16 weights, x rounded to bf16 once per call, vdpbf16ps into float32 sums. path:
    "decode" (the streamed decode kernel), "panel" (the prefill GEMM) or "auto" (by row
    count). Raises
    ValueError where the CPU has no avx512bf16 (bf16_isa() == "none")."""
    lib = _lib()
    if int(ggml_type) not in (1, 30):
        raise ValueError(f"ggml type {ggml_type} has no bf16 dot-product kernel (F16 or BF16)")
    args = _gemm_args(ggml_type, w, k, x, out, col0, "qgemm_bf16", "qgemm")
    if args is not None:
        rc = lib.iterserve_k_bf16(_BF16_PATHS[path], *args)
        if rc == 4:
            raise ValueError("the bf16 dot-product kernels are not available on this CPU")
        _rc(rc)


# --- streamed decode kernels for F16 weights (f16dot.c) ------------------------------------

_F16_PATHS = {"auto": 0, "avx2": 1, "avx512": 2}


def qgemm_f16(w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor, col0: int = 0,
              isa: str = "auto") -> None:
    """`qgemm` of F16 weights on the streamed kernels at any row count (tests, benchmarks):
    isa "auto" (the one `gemm_isa` says), "avx2" or "avx512" (ValueError where the CPU lacks
    it). Exact float32: equals x @ dequant(W)^T up to summation order."""
    lib = _lib()
    args = _gemm_args(1, w, k, x, out, col0, "qgemm_f16", "qgemm")
    if args is not None:
        rc = lib.iterserve_k_f16(_F16_PATHS[isa], *args)
        if rc == 4:
            raise ValueError(f"the {isa} F16 kernel is not available on this CPU")
        _rc(rc)


# --- dequantisation, elementwise ops, attention -------------------------------------------

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


def swiglu_oai(gu, out, interleaved: bool, alpha: float, limit: float) -> torch.Tensor:
    """out[T, I] = gpt-oss's expert activation of gu float32 [T, 2I] (gate rows then up rows,
    or alternating when `interleaved`): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha *
    g), g = min(gate, limit); both contiguous."""
    lib = _lib()
    _f32(gu, "gu", 2)
    _f32(out, "out", 2)
    if gu.shape[1] % 2 or tuple(out.shape) != (gu.shape[0], gu.shape[1] // 2):
        raise ValueError(f"swiglu_oai of {tuple(gu.shape)} into {tuple(out.shape)}")
    lib.iterserve_swiglu_oai(gu.data_ptr(), out.data_ptr(), gu.shape[0], out.shape[1],
                             int(interleaved), alpha, limit)
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
                     block_size: int = 0, scale: float = 1.0, out=None, sinks=None):
    """Attention of one query per sequence over its context in the paged pool: q, out float32
    contiguous [D, H, d]; kpool/vpool float32 or float16 (both alike) contiguous
    [slots, kvh * d]; tables int32
    [D, max_blocks], lens int32 [D] (context lengths, the new token included); window 0 or a
    sliding window; sinks None or float32 [H], one attention-sink logit per query head
    (gpt-oss). Returns out.

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
        out.data_ptr(), _threads(), kv_type(kpool), _sinks_ptr(sinks, H)))
    return out


def _sinks_ptr(sinks, H: int):
    """The data pointer of float32 [H] sinks (None: NULL, no sinks)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32 \
            or sinks.device.type != "cpu" or tuple(sinks.shape) != (H,) \
            or not sinks.is_contiguous():
        raise ValueError(f"sinks must be a contiguous float32 CPU tensor [{H}]")
    return sinks.data_ptr()


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

    def run(self, q, kpool, vpool, scale: float, out, isa: str = "auto", sinks=None):
        """Causal attention of the chunks over the paged pool: q, out float32 contiguous
        [T, H, d]; kpool/vpool float32, float16 or bfloat16 (both alike) contiguous
        [slots, kvh * d]; sinks None or float32 [H] (see decode_attention). Writes only the
        chunks' rows of out; returns out."""
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
            PREFILL_ISAS[isa], _sinks_ptr(sinks, H)))
        return out


def prefill_attention(q, kpool, vpool, q_starts, ctx, qlens, tables, window: int,
                      block_size: int, scale: float, out, isa: str = "auto", sinks=None):
    """Causal attention of prefill chunks over the paged pool (prefill_attention.c) in one
    call: `PrefillChunks(q_starts, ctx, qlens, tables, window, block_size).run(q, kpool,
    vpool, scale, out, isa, sinks)` (see both). The engine makes the PrefillChunks once per
    step."""
    return PrefillChunks(q_starts, ctx, qlens, tables, window, block_size).run(
        q, kpool, vpool, scale, out, isa, sinks)
