"""Read an HF model directory: config.json and (possibly sharded) safetensors weights.

The safetensors files are memory-mapped, not read: a safetensors file is an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
then the raw little-endian tensor bytes. Each tensor becomes a `weights.TensorRef` over a
copy-on-write mapping of its file, so bf16 / fp16 weights stay bf16 / fp16 (widened per tile
at use) and nothing is copied at load (safetensors' own `load_file` reads every tensor into
fresh memory).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from gguf import GGMLQuantizationType

from iterserve.errors import ModelLoadError
from iterserve.model.weights import BF16, F16, F32, TensorRef, map_file

# safetensors dtype -> GGML type of the same bytes. U8 are raw bytes (gpt-oss's MXFP4 expert
# blocks and scales: model/mxfp4.py reads them), typed I8 here as a plain byte array.
U8 = int(GGMLQuantizationType.I8)
_DTYPES = {"F32": F32, "F16": F16, "BF16": BF16, "U8": U8}
_ELEM = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1}
_MAX_HEADER = 100 << 20


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory} has no config.json; not an HF model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files to read: the index's shards if there is one, else every file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({directory / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shards named in {index.name} are missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weights")
    return files


def read_hf_weights(directory: Path) -> dict[str, TensorRef]:
    """HF-named references to every tensor of the directory's safetensors files."""
    refs: dict[str, TensorRef] = {}
    for f in weight_files(directory):
        refs.update(read_safetensors(f))
    return refs


def read_safetensors(path: Path) -> dict[str, TensorRef]:
    """The tensors of one safetensors file as references into its mapping."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"cannot read {path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise ModelLoadError(f"cannot read {path}: not a safetensors file (header length "
                                 f"{n} in a {size}-byte file)")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read {path}: bad safetensors header: {e}") from None
    header.pop("__metadata__", None)
    base = 8 + n
    mapping = np.zeros(0, dtype=np.uint8) if size == base else map_file(str(path))
    out: dict[str, TensorRef] = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), \
                info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"cannot read {path}: bad header entry for {name!r}") from None
        if dtype not in _DTYPES:
            raise ModelLoadError(f"{path}: tensor {name!r} has dtype {dtype}; iterserve reads "
                                 f"F32, F16 and BF16 safetensors (and U8 MXFP4 blocks)")
        elem = _ELEM[dtype]
        if end - begin != elem * int(np.prod(shape)) or base + end > size or begin < 0:
            raise ModelLoadError(f"cannot read {path}: tensor {name!r} has a byte range that "
                                 f"does not fit its shape or the file (truncated?)")
        view = torch.from_numpy(mapping[base + begin:base + end].view(np.ndarray))
        out[name] = TensorRef(name, _DTYPES[dtype], shape, str(path), base + begin,
                              end - begin, view, file_map=mapping)
    return out
