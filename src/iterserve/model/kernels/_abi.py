"""The kernels' ABI on the Python side, once: ctypes copies of iterserve.h's structs and
prototypes, and the check that a built library describes itself the same way.

Why a check: a ctypes declaration that drifts from the header passes misplaced pointers
without any error; `iterserve_abi()` reports the library's struct sizes and offsets and its
per-type block table, and `check_abi` refuses a library that disagrees with what ctypes and
gguf-py compute.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

ABI_VERSION = 9                      # iterserve.h's ITERSERVE_ABI_VERSION


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


class Moe(ctypes.Structure):
    """iterserve.h's iterserve_moe: a Mixture-of-Experts block (router + per-expert arrays)."""
    _fields_ = [("num_experts", ctypes.c_int64), ("top_k", ctypes.c_int64),
                ("inter", ctypes.c_int64), ("norm_topk", ctypes.c_int64),
                ("router", Linear), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("routing", ctypes.c_int64), ("act", ctypes.c_int64),
                ("interleaved", ctypes.c_int64), ("alpha", ctypes.c_float),
                ("limit", ctypes.c_float), ("router_bias", ctypes.c_void_p),
                ("gate_up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """iterserve.h's iterserve_layer: one decoder layer for iterserve_decode_layers."""
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p),
                ("qkv_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p),
                ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("moe", ctypes.c_void_p), ("o_bias", ctypes.c_void_p),
                ("sinks", ctypes.c_void_p), ("window", ctypes.c_int64)]


class Config(ctypes.Structure):
    """iterserve.h's iterserve_config: what `configure` hands the library."""
    _fields_ = [("activations", ctypes.c_int64), ("isa", ctypes.c_int64),
                ("batch_invariant", ctypes.c_int64)]


_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_GEMM = [_i64, _p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64, _i32]
# name -> (restype, argtypes), exactly as iterserve.h declares them
ARGTYPES = {
    "iterserve_abi": (_i64, [_p, _i64]),
    "iterserve_cpu_features": (_i64, []),
    "iterserve_configure": (None, [_p]),
    "iterserve_config_state": (_i64, [_p, _i64]),
    "iterserve_qgemm": (None, _GEMM),
    "iterserve_gemm": (_i32, _GEMM),
    "iterserve_qgemm_act": (None, [_i32, *_GEMM]),
    "iterserve_gemm_act": (_i32, [_i32, *_GEMM]),
    "iterserve_linear_kernel": (_i32, [_i64, *_GEMM]),
    "iterserve_route": (_i64, [_i64, _i64, _i64]),
    "iterserve_route_act": (_i64, [_i64, _i64, _i64, _i32]),
    "iterserve_can_act8": (_i32, [_i64]),
    "iterserve_can_gemm8": (_i32, [_i64]),
    "iterserve_dequant": (None, [_i64, _p, _i64, _i64, _i64, _p, _i64, _i32]),
    "iterserve_k_bf16": (_i32, [_i64, *_GEMM]),
    "iterserve_k_f16": (_i32, [_i64, *_GEMM]),
    "iterserve_decode_profile": (_i32, [_p]),
    "iterserve_moe_route": (None, [_p, _i64, _i64, _i64, _i64, _i64, _p, _p]),
    "iterserve_moe_forward": (_i32, [_p, _p, _i64, _i64, _p, _i32]),
    "iterserve_rmsnorm": (None, [_p, _p, _p, _i64, _i64, _f32]),
    "iterserve_silu_mul": (None, [_p, _p, _i64, _i64]),
    "iterserve_swiglu_oai": (None, [_p, _p, _i64, _i64, _i64, _f32, _f32]),
    "iterserve_rope": (None, [_p, _i64, _i64, _i64, _i64, _p, _p]),
    "iterserve_qk_norm": (None, [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _f32]),
    "iterserve_decode_attention": (_i32, [_p, _p, _p, _i64, _p, _i32, _p, _i32, _i32, _i32,
                                          _i32, _i32, _i32, _f32, _p, _i32]),
    "iterserve_decode_layers": (_i32, [_p, _i32, _p, _p, _i64, _p, _i64, _i64, _i32, _i32,
                                       _i32, _i64, _f32, _p, _p, _p, _p, _i32, _p, _i32, _i32,
                                       _f32, _i32]),
    # float32 or f16 KV pools (kv_type 0 / 1): the two above with a pool element type
    "iterserve_decode_attention_kv": (_i32, [_p, _p, _p, _i64, _p, _i32, _p, _i32, _i32, _i32,
                                             _i32, _i32, _i32, _f32, _p, _i32, _i32, _p]),
    "iterserve_decode_layers_kv": (_i32, [_p, _i32, _p, _p, _i64, _p, _i64, _i64, _i32, _i32,
                                          _i32, _i64, _f32, _p, _p, _p, _p, _i32, _p, _i32, _i32,
                                          _f32, _i32, _i32]),
    # prefill chunks over the pool (prefill_attention.c): float32 / f16 / bf16 pools
    "iterserve_prefill_attention": (_i32, [_p, _p, _p, _i64, _i32, _p, _p, _p, _p, _i32, _i32,
                                           _i32, _i32, _i32, _i32, _f32, _p, _i32, _i32, _i32,
                                           _p]),
    "iterserve_prefill_attention_isa": (_i64, [_i64, _i64]),
}
ERRORS = {1: "a block table entry lies outside the KV pool",
           2: "a slot lies outside the KV pool",
           3: "a context length is < 1 or longer than its block table",
           4: "unsupported type", 5: "out of memory"}
FEATURE_BITS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni",
                "avx512bf16", "avxvnni", "avx512vbmi")
CPUINFO_NAMES = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f",
                  "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512_vnni": "avx512vnni",
                  "avx512_bf16": "avx512bf16", "avx_vnni": "avxvnni",
                 "avx512vbmi": "avx512vbmi"}


@dataclass(frozen=True)
class TypeCaps:
    block_elems: int
    block_bytes: int
    qgemm: bool
    dequant: bool


def abi_expected() -> list[int]:
    o = ctypes.sizeof
    S, L, Y = Segment, Linear, Layer
    return [ABI_VERSION, o(S), S.type.offset, S.rows.offset, S.row_bytes.offset,
            S.row_stride.offset, S.data.offset, o(L), L.nseg.offset, L.k.offset, L.seg.offset,
            MAX_SEGMENTS, o(Y), Y.ln1.offset, Y.ln2.offset, Y.qkv_bias.offset,
            Y.q_norm.offset, Y.k_norm.offset, Y.qkv.offset, Y.o.offset, Y.gate_up.offset,
            Y.down.offset, Y.moe.offset, Y.o_bias.offset, Y.sinks.offset, Y.window.offset,
            o(Moe), Moe.num_experts.offset, Moe.top_k.offset,
            Moe.inter.offset, Moe.norm_topk.offset, Moe.router.offset, Moe.gate_up.offset,
            Moe.down.offset, Moe.routing.offset, Moe.act.offset, Moe.interleaved.offset,
            Moe.alpha.offset, Moe.limit.offset, Moe.router_bias.offset, Moe.gate_up_bias.offset,
            Moe.down_bias.offset, o(Config), Config.activations.offset, Config.isa.offset,
            Config.batch_invariant.offset]


def check_abi(lib: ctypes.CDLL) -> dict[int, TypeCaps]:
    """Compare the library's self-description with ctypes' and gguf's; the type table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = (ctypes.c_int64 * 512)()
    n = lib.iterserve_abi(buf, 512)
    got = list(buf[:n])
    want = abi_expected()
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
