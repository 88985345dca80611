"""Native CPU kernels: C sources compiled on first use with the system C compiler, loaded by ctypes.

Kernels for where a CPU step spends its time, all over weights in their GGUF encoding (rows of
blocks exactly as in the file; type ids are `gguf.GGMLQuantizationType` values):
- `dispatch.c`: the one routing table of the linear layers, (type, rows, activation mode) ->
  kernel, behind `qgemm` (decode row counts) and `gemm` (prefill chunks, large batches);
  every kernel file below is a leaf it calls;
- `qgemm.c` / `dequant.c` / `blocks512.h`: float register kernels (AVX2 and AVX-512) for
  Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K / F16 / BF16 / F32, a decode-into-L1
  kernel for every other type, and `dequant` (rows -> float32, bit-exact with gguf-py);
- `prefill.c`: the float32 panel GEMM (weight panels decoded into an L1 scratch,
  register-blocked micro-kernels);
- `qdot8.c` / `prefill8.c`: the same products with activations quantised to 8 bits and
  integer dot products (decode kernels, panel GEMM);
- `bf16dot.c` / `f16dot.c`: bf16 dot products (avx512bf16) and streamed exact F16 kernels;
- `decode_attention.c`, `prefill_attention.c` (+ `prefill_attention_impl.h`): attention over
  the paged KV pool (model/attention.py);
- `elementwise.c`: RMSNorm, SiLU x up, RoPE and Qwen3's q/k norm in one call each;
- `moe.c`: a Mixture-of-Experts block (routing and the chosen experts) in one call;
- `decode_layers.c`: all decoder layers of a small decode-only step in one call;
- `config.c`: the one configuration the kernels read.

This package is their face: `build` (compile, cache, load), `_abi` (the ctypes copy of
iterserve.h, checked against the library), `config` (`KernelConfig`, `configure`), `ops`
(one checked wrapper per kernel), `moe` (`MoeBlock`, `route`) and `decode_layers`
(`DecodeLayers`).
"""

from __future__ import annotations

from iterserve.model.kernels import build as _build_module
from iterserve.model.kernels._abi import MAX_SEGMENTS, Layer, Linear, Segment, TypeCaps
from iterserve.model.kernels.build import (_build, _compiler,
                                           _cpu_has_avx2_fma, _cpuinfo_features, _lib, _library,
                                           available, cache_dir, clear_cache, features,
                                           supports_dequant, supports_qgemm)
from iterserve.model.kernels.config import (ACTIVATION_MODES, KernelConfig, activations,
                                            bf16_isa, config, configure, gemm_isa, int8_isa,
                                            set_activations, set_batch_invariant)
from iterserve.model.kernels.decode_layers import DecodeLayers, LayerSpec
from iterserve.model.kernels.moe import MoeBlock
from iterserve.model.kernels.moe import route as moe_route
from iterserve.model.kernels.ops import (KV_TYPES, PREFILL_ISAS, PREFILL_KV_TYPES, PrefillChunks,
                                         bf16_takes, decode_attention, dequant, f16_takes, gemm,
                                         gemm_int8, kv_type, prefill_attention,
                                         prefill_attention_isa, qgemm, qgemm_bf16, qgemm_f16,
                                         qgemm_int8, qgemm_path, qgemm_split8, qk_norm,
                                         rmsnorm, rope, route, row_bytes, silu_mul,
                                         supports_gemm_int8, supports_int8, swiglu_oai)


def __getattr__(name: str):
    if name == "unavailable":                 # why the kernels are not in use (set on load)
        return _build_module.unavailable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ACTIVATION_MODES", "DecodeLayers", "KV_TYPES", "KernelConfig",
    "Layer", "LayerSpec", "Linear", "MAX_SEGMENTS", "MoeBlock", "moe_route", "PREFILL_ISAS", "PREFILL_KV_TYPES",
    "PrefillChunks", "Segment", "TypeCaps", "activations", "available", "bf16_isa",
    "bf16_takes", "cache_dir", "clear_cache", "config", "configure", "decode_attention",
    "dequant", "f16_takes", "features", "gemm", "gemm_int8", "gemm_isa", "int8_isa", "kv_type",
    "prefill_attention", "prefill_attention_isa", "qgemm", "qgemm_bf16", "qgemm_f16",
    "qgemm_int8", "qgemm_split8", "qgemm_path", "qk_norm", "rmsnorm", "rope", "route", "row_bytes",
    "set_activations", "set_batch_invariant", "silu_mul", "supports_dequant", "supports_gemm_int8", "supports_int8",
    "swiglu_oai",
]
