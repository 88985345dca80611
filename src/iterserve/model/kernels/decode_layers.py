"""The binding of decode_layers.c: every decoder layer of a decode-only step in one call.

`LayerSpec` holds one layer's tensors (an MoE layer: a `kernels.moe.MoeBlock` in place of
gate_up / down); `DecodeLayers` builds the C descriptors
(iterserve.h's iterserve_layer) once per model, checks every shape, and runs the step,
calling the same linear kernels (dispatch.c) as the per-module path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from iterserve.model.kernels._abi import Layer, Linear
from iterserve.model.kernels.build import _lib, available, supports_qgemm
from iterserve.model.kernels.moe import MoeBlock
from iterserve.model.kernels.ops import (_cos_sin, _f32, _pools, _rc, _tables, _threads,
                                         kv_type, linear_struct)


@dataclass
class LayerSpec:
    """One decoder layer's tensors for DecodeLayers. Each weight is a list of 1-3
    `(ggml_type, w)` row segments stacked in output order (w uint8 [rows, row_bytes] in GGUF
    blocks), e.g. q, k, v of a Q4_K_M file in their own types."""
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: list[tuple[int, torch.Tensor]]
    o: list[tuple[int, torch.Tensor]]
    gate_up: list[tuple[int, torch.Tensor]] | None      # None in an MoE layer
    down: list[tuple[int, torch.Tensor]] | None
    qkv_bias: torch.Tensor | None = None       # Qwen2
    q_norm: torch.Tensor | None = None         # Qwen3 (with k_norm)
    k_norm: torch.Tensor | None = None
    moe: MoeBlock | None = None                # experts instead of gate_up / down
    o_bias: torch.Tensor | None = None         # gpt-oss (with sinks and per-layer windows)
    sinks: torch.Tensor | None = None          # [num_heads] attention-sink logits
    window: int = 0                            # the layer's sliding window; 0: run's window


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
        self._blocks: list[MoeBlock] = []             # the expert blocks the layers point to
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
            L.o_bias = None if spec.o_bias is None else \
                self._vec(spec.o_bias, hidden, f"layer {i} o_bias")
            L.sinks = None if spec.sinks is None else \
                self._vec(spec.sinks, num_heads, f"layer {i} sinks")
            if spec.window < 0:
                raise ValueError(f"layer {i}: window {spec.window}")
            L.window = spec.window
            self._linear(L.qkv, spec.qkv, qkvw, hidden, f"layer {i} qkv")
            self._linear(L.o, spec.o, hidden, num_heads * head_dim, f"layer {i} o")
            if spec.moe is not None:
                if spec.moe.hidden != hidden:
                    raise ValueError(f"layer {i}: experts of width {spec.moe.hidden}, not {hidden}")
                L.moe = spec.moe.address
                self._blocks.append(spec.moe)
                continue
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
                   for segs in (s.qkv, s.o, s.gate_up or [], s.down or []) for t, _ in segs)

    def _vec(self, t, n: int, name: str) -> int:
        _f32(t, name, 1)
        if t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} elements, not {n}")
        self._keep.append(t)
        return t.data_ptr()

    def _linear(self, dst: Linear, segments, n: int, k: int, name: str) -> None:
        linear_struct(dst, segments, n, k, name, self._keep)

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
