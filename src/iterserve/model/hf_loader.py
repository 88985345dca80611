"""Read an HF model directory: config.json and (possibly sharded) safetensors weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from iterserve.model.config import ModelLoadError


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


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(directory):
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read {f}: {e}") from None
    return state
