"""Weights in their file's encoding: tensor references into a mapped file, and row segments.

Why: a float32 copy of a weight costs 4 bytes per weight, 7-8x a Q4 file; a copy of every
tensor at load (and another to fuse q/k/v and to prepack) multiplies a model's memory. Here a
weight stays what the file stores, and the memory a model takes is a function of its file:

- `TensorRef` points at one tensor of a GGUF or safetensors file: its GGML type
  (`gguf.GGMLQuantizationType` value; safetensors' F32/F16/BF16 map to GGML's F32/F16/BF16),
  shape in HF order ([out, in] for a matrix), and byte range. `view()` is a zero-copy view of
  the file's copy-on-write mapping (nothing is read until used); `read_into()` reads the bytes
  with plain file reads into a caller's buffer, so the mapping's pages of that tensor are never
  touched (the process maps each byte of the file at most once: RSS stays ~1x the file).
  A `row_perm` (llama's Q/K un-permutation) is a row gather: GGUF rows are whole blocks, so
  reordering rows never looks inside a block.
- `EncodedWeight` is a [rows, k] matrix as one or more row segments `(ggml_type, uint8
  [rows, row_bytes])` stacked in output order: the layout `kernels.qgemm` and
  `kernels.DecodeLayers` read. `fuse()` builds it from the parts of a fused weight (q/k/v,
  gate/up): one segment per run of consecutive parts of one type (Q4_K_M keeps some v /
  down tensors in Q6_K: those are a segment of their own). A run that is one range of the
  file - a lone tensor, or neighbours like an HF checkpoint's q/k/v and gate/up - is a view
  of the mapping (nothing copied, pages read at first use); any other run is read with one
  file read per tensor into one anonymous buffer (llama's Q/K rows gathered on the way).
  Why not always separate in-place segments (the kernels take up to 3): each segment is one
  more GEMM call and thread fork/join per layer per step; measured on 1.7B Q4_0 gate/up,
  +2% per call quiet and ~1.5x at the median on this loaded 2-core machine, so a decode
  step would pay every time what the copy costs once at load.
- `decode_rows()` widens a bounded block of rows to float32 (the reference path's tile and the
  embedding lookup): F32/F16/BF16 by a dtype conversion, block types by `kernels.dequant` where
  the native library has it, else by gguf-py's numpy dequantiser (the numerical reference).
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from iterserve.model import kernels

F32, F16, BF16 = (int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16),
                  int(GGMLQuantizationType.BF16))
FLOAT_TYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
TORCH_TO_GGML = {v: k for k, v in FLOAT_TYPES.items()}
# The GGUF types a user meets (llama.cpp's quantize presets); every one loads and computes.
SUPPORTED_TYPES = {int(GGMLQuantizationType[n]) for n in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")}
MXFP4 = int(GGMLQuantizationType.MXFP4)   # gpt-oss's experts: decoded by model/mxfp4.py

# Bytes of float32 scratch one reference-path tile may take (rows of a weight widened at
# use): big enough that the GEMM over a tile runs at full speed, small enough to stay in L2/L3.
TILE_BYTES = 4 << 20


def type_name(ggml_type: int) -> str:
    return GGMLQuantizationType(ggml_type).name


def row_bytes(ggml_type: int, k: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if k % block:
        raise ValueError(f"a {type_name(ggml_type)} row of {k} weights is not a whole number "
                         f"of {block}-weight blocks")
    return k // block * size


@dataclass(eq=False)
class TensorRef:
    """One tensor of a mapped file, not read until used."""
    name: str
    ggml_type: int
    shape: tuple[int, ...]          # HF order: [out, in] for a matrix
    path: str
    offset: int                     # absolute byte offset in the file
    nbytes: int
    mapping: torch.Tensor           # uint8 [nbytes], zero-copy view of the file's mapping
    row_perm: np.ndarray | None = field(default=None, repr=False)   # new row i = old row perm[i]
    # the whole file's mapping (uint8, offsets are into it), so fuse() can view neighbours
    # as one range; None where the reference is not a plain range of the file
    file_map: np.ndarray | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1

    @property
    def k(self) -> int:
        return int(self.shape[-1])

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows

    def with_row_perm(self, perm: np.ndarray) -> "TensorRef":
        return TensorRef(self.name, self.ggml_type, self.shape, self.path, self.offset,
                         self.nbytes, self.mapping, np.asarray(perm), self.file_map)

    def view(self) -> torch.Tensor:
        """uint8 [rows, row_bytes]: the mapping itself when rows are in file order, else the
        rows read and gathered into a new buffer."""
        if self.row_perm is None:
            return self.mapping.view(self.rows, self.row_bytes)
        out = torch.empty(self.rows, self.row_bytes, dtype=torch.uint8)
        self.read_into(out)
        return out

    def read_into(self, out: torch.Tensor) -> None:
        """Read the tensor's bytes (rows gathered by row_perm) into `out`, uint8 [rows,
        row_bytes] contiguous, with file reads: the mapping's pages stay untouched."""
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != self.nbytes:
            raise ValueError(f"{self.name}: read_into needs a contiguous uint8 buffer of "
                             f"{self.nbytes} bytes")
        if self.row_perm is None:
            _pread(self, memoryview(out.numpy()).cast("B"))
            return
        # Read into a reused scratch, then gather the rows into `out` in one pass.
        tmp = _read_scratch(self.nbytes)
        _pread(self, memoryview(tmp.numpy()).cast("B"))
        torch.index_select(tmp.view(self.rows, self.row_bytes), 0,
                           torch.from_numpy(self.row_perm).to(torch.long),
                           out=out.view(self.rows, self.row_bytes))

    def to_float(self) -> torch.Tensor:
        """float32 copy in HF shape: for small tensors (norms, biases) and for tests."""
        rows = self.view()
        out = torch.empty(self.rows, self.k, dtype=torch.float32)
        decode_rows(self.ggml_type, rows, self.k, out)
        return out.view(self.shape)


def _pread(ref: TensorRef, buf: memoryview) -> None:
    """The tensor's file bytes into `buf` with plain reads (the mapping stays untouched)."""
    with open(ref.path, "rb", buffering=0) as f:
        done = 0
        while done < ref.nbytes:
            n = os.preadv(f.fileno(), [buf[done:ref.nbytes]], ref.offset + done)
            if n <= 0:
                raise OSError(f"{ref.path}: short read of tensor {ref.name!r} "
                              f"({done} of {ref.nbytes} bytes); is the file truncated?")
            done += n


_read_buf = threading.local()


def _read_scratch(nbytes: int) -> torch.Tensor:
    """A reused uint8 buffer of nbytes for a gathered read (freed by release_read_scratch)."""
    buf = getattr(_read_buf, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _read_buf.buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes]


def release_read_scratch() -> None:
    """Drop this thread's gather buffer (the loader calls it when the weights are in)."""
    _read_buf.buf = None


def map_file(path: str) -> np.ndarray:
    """The whole file as a uint8 array over a private copy-on-write mapping.

    Copy-on-write so tensor views are writable numpy arrays (torch.from_numpy takes them
    without a copy); nothing is ever written to them. The kernel is told the pages will be
    needed (MADV_WILLNEED, as llama.cpp's loader does): on a cold page cache it reads ahead
    in the background while the header, tokenizer and model are set up, instead of page by
    page at the first forward pass."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return np.zeros(0, dtype=np.uint8)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
        try:
            mm.madvise(mmap.MADV_WILLNEED)
        except OSError:
            pass
    return np.frombuffer(mm, dtype=np.uint8)


# --- decoding rows -----------------------------------------------------------------------

def _native():
    """The kernels module when its GGUF-native API is there, else None."""
    if not hasattr(kernels, "supports_dequant") or not kernels.available():
        return None
    return kernels


def native_dequant(ggml_type: int) -> bool:
    k = _native()
    return k is not None and bool(k.supports_dequant(ggml_type))


def decode_rows(ggml_type: int, w: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """Widen encoded rows `w` (uint8 [n, row_bytes]) into `out` (float32 [n, k]); returns out."""
    if ggml_type in FLOAT_TYPES:
        out.copy_(w.view(FLOAT_TYPES[ggml_type]))
        return out
    kern = _native()
    if kern is not None and kern.supports_dequant(ggml_type):
        kern.dequant(ggml_type, w, k, out)
        return out
    if ggml_type == MXFP4:
        from iterserve.model import mxfp4
        return mxfp4.dequant(w, k, out)
    from gguf import quants
    ref = quants.dequantize(w.numpy(), GGMLQuantizationType(ggml_type))
    out.copy_(torch.from_numpy(ref.reshape(out.shape)))
    return out


_scratch = threading.local()


def scratch(n: int, k: int) -> torch.Tensor:
    """A reusable float32 [n, k] buffer for this thread (the reference path's tile)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n * k:
        # a normal tensor even when first asked for inside inference_mode (the model's
        # forward): an inference tensor could not be written outside it later
        with torch.inference_mode(False):
            buf = _scratch.buf = torch.empty(n * k, dtype=torch.float32)
    return buf[:n * k].view(n, k)


def tile_rows(k: int) -> int:
    """Rows per reference-path tile for rows of k weights (a multiple of 16, at least 16)."""
    return max(16, (TILE_BYTES // (4 * k)) // 16 * 16)


# --- weights as row segments --------------------------------------------------------------

def _adjacent(a: TensorRef, b: TensorRef) -> bool:
    """b's rows start where a's end, in one mapping of one file, both in file order."""
    return (type(a) is TensorRef and type(b) is TensorRef and a.file_map is not None
            and b.file_map is a.file_map and a.row_perm is None and b.row_perm is None
            and a.ggml_type == b.ggml_type and a.row_bytes == b.row_bytes
            and b.offset == a.offset + a.nbytes)


def _groups(parts: list[TensorRef], joins) -> list[list[TensorRef]]:
    """Consecutive parts split where `joins(previous, next)` is false."""
    out: list[list[TensorRef]] = []
    for p in parts:
        if out and joins(out[-1][-1], p):
            out[-1].append(p)
        else:
            out.append([p])
    return out


class EncodedWeight:
    """A [rows, k] weight as row segments `(ggml_type, uint8 [rows_i, row_bytes_i])`."""

    def __init__(self, segments: list[tuple[int, torch.Tensor]], k: int,
                 names: tuple[str, ...] = ()) -> None:
        if not segments:
            raise ValueError("a weight needs at least one segment")
        for t, w in segments:
            if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != row_bytes(t, k):
                raise ValueError(f"segment of type {type_name(t)} has shape {tuple(w.shape)}, "
                                 f"expected [rows, {row_bytes(t, k)}] for k={k}")
        self.segments = segments
        self.k = k
        self.names = names

    @property
    def rows(self) -> int:
        return sum(w.shape[0] for _, w in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.k

    @property
    def nbytes(self) -> int:
        return sum(w.numel() for _, w in self.segments)

    @property
    def types(self) -> list[int]:
        return [t for t, _ in self.segments]

    def bytes_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t, w in self.segments:
            out[type_name(t)] = out.get(type_name(t), 0) + w.numel()
        return out

    def dense_f32(self) -> torch.Tensor | None:
        """The float32 [rows, k] matrix itself (zero copy) when it is one F32 segment."""
        if len(self.segments) == 1 and self.segments[0][0] == F32:
            return self.segments[0][1].view(torch.float32)
        return None

    @classmethod
    def fuse(cls, parts: list[TensorRef]) -> "EncodedWeight":
        """Stack the parts' rows in order; see the module docstring for what is copied."""
        k = parts[0].k
        if any(p.k != k or len(p.shape) != 2 for p in parts):
            raise ValueError(f"cannot fuse {[p.name for p in parts]}: shapes "
                             f"{[p.shape for p in parts]} differ in their inner dimension")
        for p in parts:
            if p.ggml_type not in SUPPORTED_TYPES:
                raise ValueError(f"tensor {p.name!r} has type {type_name(p.ggml_type)}, which "
                                 f"is not supported")
        # One segment per run of consecutive parts of one type (each extra segment is one
        # more GEMM call, one more thread fork/join, per step). A run that is one range of
        # the file (a lone tensor; neighbours such as HF's q/k/v or gate/up) is a view of the
        # mapping; any other run is read into one buffer (llama's Q/K rows gathered).
        segments = []
        for g in _groups(parts, lambda a, b: a.ggml_type == b.ggml_type):
            if g[0].row_perm is None and all(_adjacent(x, y) for x, y in zip(g, g[1:])):
                if len(g) == 1:
                    segments.append((g[0].ggml_type, g[0].view()))
                else:
                    lo, hi = g[0].offset, g[-1].offset + g[-1].nbytes
                    segments.append((g[0].ggml_type, torch.from_numpy(
                        g[0].file_map[lo:hi]).view(-1, g[0].row_bytes)))
                continue
            buf = torch.empty(sum(p.rows for p in g), g[0].row_bytes, dtype=torch.uint8)
            r = 0
            for p in g:
                p.read_into(buf[r:r + p.rows])
                r += p.rows
            segments.append((g[0].ggml_type, buf))
        return cls(segments, k, tuple(p.name for p in parts))

    def decode(self, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [r0, r1) as float32 into out [r1 - r0, k] (they may span segments)."""
        base, done = 0, 0
        for t, w in self.segments:
            n = w.shape[0]
            a, b = max(r0, base), min(r1, base + n)
            if a < b:
                decode_rows(t, w[a - base:b - base], self.k, out[done:done + b - a])
                done += b - a
            base += n
        return out

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), k]: only the looked-up rows decoded (an embedding lookup)."""
        ids = ids.reshape(-1).to(torch.long)
        out = torch.empty(ids.numel(), self.k, dtype=torch.float32)
        if len(self.segments) == 1:
            t, w = self.segments[0]
            return decode_rows(t, w.index_select(0, ids), self.k, out)
        base = 0
        for t, w in self.segments:
            n = w.shape[0]
            sel = ((ids >= base) & (ids < base + n)).nonzero().flatten()
            if sel.numel():
                out[sel] = decode_rows(t, w.index_select(0, ids[sel] - base), self.k,
                                       torch.empty(sel.numel(), self.k))
            base += n
        return out

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as float32: tests and the CUDA path only (never on CPU serving)."""
        return self.decode(0, self.rows, torch.empty(self.rows, self.k))

    def to(self, device) -> "EncodedWeight":
        return EncodedWeight([(t, w.to(device)) for t, w in self.segments], self.k, self.names)
