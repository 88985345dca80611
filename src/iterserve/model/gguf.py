"""GGUF files: the header (metadata and tensor table) parsed in one pass over the file's mapping.

GGUF is llama.cpp's single-file format (the spec is ggml's docs/gguf.md): a magic and a
version, key/value metadata under llama.cpp's names, then one info record per tensor (name,
shape, quantisation type, offset), then the tensor data, aligned. `open_gguf(path)` gives
the header; what it means is the readers' business: the model loader (model/gguf_loader.py:
config, weights) and the tokenizer (model/tokenizer.py: the vocabulary), which share this
parser and nothing else.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from iterserve.errors import GGUFLoadError
from iterserve.model.weights import map_file

__all__ = ["GGUFHeader", "open_gguf"]


class _Field:
    """A metadata value, decoded at parse: `contents()` as gguf-py's ReaderField gives it."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, value) -> None:
        self.name, self.value = name, value

    def contents(self):
        return self.value


class _Tensor:
    """A tensor's info, as gguf-py's ReaderTensor names it (shape in GGUF order: ne0 first)."""

    __slots__ = ("name", "tensor_type", "shape", "n_elements", "n_bytes", "data_offset")

    def __init__(self, name, tensor_type, shape, n_elements, n_bytes, data_offset) -> None:
        self.name, self.tensor_type, self.shape = name, tensor_type, shape
        self.n_elements, self.n_bytes, self.data_offset = n_elements, n_bytes, data_offset


# GGUF value type -> (struct format, size) of the scalar types (gguf.GGUFValueType numbers)
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4),
            5: ("<i", 4), 6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8),
            12: ("<d", 8)}
_STRING, _ARRAY = 8, 9


class _NotReadHere(Exception):
    """A valid GGUF this parser does not read (byte order, version): gguf-py's reader does."""


class GGUFHeader:
    """A GGUF file's metadata and tensor table, parsed in one pass over its mapping.

    Why not gguf-py's GGUFReader: it builds two numpy views per string of a vocabulary
    (~100k strings for tokens + merges, more for token types) and decodes them again on
    every `contents()`; opening a converter-made SmolLM2 GGUF took 1.4-2.2 s, most of its
    metadata + tokenizer time. This reads the same layout (GGUF v2/v3, little-endian: the
    spec in ggml's docs/gguf.md) with `struct` straight from the mapping and decodes each
    value once. The interface is the subset the loader and the tokenizer use: `fields`
    (name -> object with `contents()`), `tensors` (name, tensor_type, shape, n_bytes,
    data_offset), `data` (the uint8 mapping). Big-endian files (rare) go to gguf-py's reader.
    `tensors=False` stops after the key/value metadata (`tensors` stays empty): all a
    tokenizer needs (`Tokenizer.from_path(x.gguf)`).
    """

    def __init__(self, path: str, tensors: bool = True) -> None:
        self.data = map_file(path)
        self.fields: dict[str, _Field] = {}
        self.tensors: list[_Tensor] = []
        self._off = 0
        buf = self._buf = memoryview(self.data)
        magic, version = buf[:4].tobytes(), self._scalar(4, skip=4)
        if magic != b"GGUF" or version not in (2, 3):
            raise _NotReadHere(f"GGUF version {version} (expected 2 or 3, little-endian)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        for name, v in (("GGUF.version", version), ("GGUF.tensor_count", n_tensors),
                        ("GGUF.kv_count", n_kv)):      # gguf-py's pseudo-fields, likewise
            self.fields[name] = _Field(name, v)
        for _ in range(n_kv):
            name = self._string()
            if name in self.fields:
                raise ValueError(f"duplicate metadata key {name!r}")
            self.fields[name] = _Field(name, self._value(self._scalar(4)))
        if not tensors:
            del self._buf
            return
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar(10) for _ in range(self._scalar(4))]
            infos.append((name, dims, self._scalar(4), self._scalar(10)))
        align = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields \
            else 32
        start = -(-self._off // align) * align
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        for name, dims, raw_type, offset in infos:
            qtype = GGMLQuantizationType(raw_type)
            block, size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims)) if dims else 1
            self.tensors.append(_Tensor(name, qtype, np.array(dims, dtype=np.uint64), n,
                                        n * size // block, start + offset))
        del self._buf

    def _scalar(self, vtype: int, skip: int = 0):
        self._off += skip
        fmt, size = _SCALARS[vtype]
        (v,) = struct.unpack_from(fmt, self._buf, self._off)
        self._off += size
        return v

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._off)
        o = self._off + 8
        if o + n > len(self._buf):
            raise ValueError("a string runs past the end of the file")
        self._off = o + n
        return str(self._buf[o:o + n], "utf-8")

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._scalar(vtype)
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        itype, n = self._scalar(4), self._scalar(10)
        if itype in _SCALARS:
            fmt, size = _SCALARS[itype]
            if self._off + n * size > len(self._buf):
                raise ValueError("an array runs past the end of the file")
            out = np.frombuffer(self._buf, dtype=np.dtype(fmt), count=n,
                                offset=self._off).tolist()
            self._off += n * size
            return out
        if itype == _STRING:
            buf, unpack, o, end = self._buf, struct.Struct("<Q").unpack_from, self._off, len(self._buf)
            out = []
            append = out.append
            for _ in range(n):
                (k,) = unpack(buf, o)
                o += 8
                if o + k > end:
                    raise ValueError("a string array runs past the end of the file")
                append(str(buf[o:o + k], "utf-8"))
                o += k
            self._off = o
            return out
        # nested arrays (rare): flattened, as gguf-py's reader gives them
        return [x for _ in range(n) for x in self._value(itype)]


def open_gguf(path, tensors: bool = True) -> GGUFHeader:
    """The parsed header of `path`, with a clear GGUFLoadError when it is not a GGUF file
    (`tensors=False`: the key/value metadata only, see GGUFHeader)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFLoadError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFLoadError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return GGUFHeader(path, tensors)
    except _NotReadHere:
        return _gguf_py_reader(path)
    except (ValueError, struct.error, KeyError, IndexError, OverflowError) as exc:
        raise GGUFLoadError(f"{path}: cannot be parsed as GGUF: {exc}") from exc


def _gguf_py_reader(path: str):
    """gguf-py's reader, for what GGUFHeader does not read (big-endian files, new versions)."""
    import gguf
    try:
        reader = gguf.GGUFReader(path, "c")
    except Exception as exc:   # truncated or corrupt files raise assorted errors in the reader
        raise GGUFLoadError(f"{path}: cannot be parsed as GGUF: {exc}") from exc
    reader.data = reader.data.view(np.ndarray)
    return reader
