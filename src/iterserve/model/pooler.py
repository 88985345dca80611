"""Pooling: one vector per prompt from a model's final hidden states (embeddings).

A decoder served as an embedder (`--runner pooling`, `--convert embed`) computes its prompt
like any prefill, in chunks through the paged KV cache, and never samples; the runner hands
each chunk's final-normed hidden rows to a `Pooler`, which keeps what the pooling type needs
across chunks (nothing for LAST, a running sum for MEAN, the first row for CLS, a running
max for MAX) and makes the vector when the last prompt token is computed.

How to pool is the checkpoint's own choice, read as sentence-transformers writes it:
`modules.json` lists Transformer -> Pooling (its `config.json`: `pooling_mode`, or the older
`pooling_mode_*_token(s)` booleans) -> Normalize; a module it does not know (Dense, ...) is
refused, since leaving it out would return other vectors than the checkpoint's. Without
those files, vLLM's default for a converted decoder: the last token, normalised.
`--pooler-config` (vLLM's JSON: `pooling_type`, `normalize`) overrides either. Matryoshka
truncation (`dimensions`) is offered only where config.json says the model was trained for
it (`matryoshka_dimensions`, or `is_matryoshka`, e.g. through `--hf-overrides`), as vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from iterserve.errors import ConfigError, InvalidRequestError

POOLING_TYPES = ("LAST", "MEAN", "CLS", "MAX", "MEAN_SQRT_LEN")

# sentence-transformers' pooling modes (new `pooling_mode` names and the older booleans).
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS", "max": "MAX",
             "mean_sqrt_len_tokens": "MEAN_SQRT_LEN"}
_ST_FLAGS = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS", "pooling_mode_max_tokens": "MAX",
             "pooling_mode_mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
             "pooling_mode_weightedmean_tokens": "WEIGHTEDMEAN"}


@dataclass(frozen=True)
class PoolerConfig:
    """How this model pools: type, normalisation, Matryoshka dimensions, and where that
    was read from (for the start-up log)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "default (last token, normalised)"

    @property
    def reads_every_row(self) -> bool:
        """Whether the vector depends on rows before the last (then no prefix-cache hits)."""
        return self.pooling_type != "LAST"

    def check_dimensions(self, dimensions: int | None) -> None:
        """A request's `dimensions`: only for a Matryoshka model, within its sizes (vLLM's
        rules and wording); a ValueError naming `dimensions` otherwise."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise InvalidRequestError(
                "this model does not support matryoshka representation (config.json has no "
                "matryoshka_dimensions / is_matryoshka), changing output dimensions will lead "
                "to poor results", "dimensions")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise InvalidRequestError(
                f"this model only supports {list(self.matryoshka_dimensions)} for matryoshka "
                f"representation, but got {dimensions}", "dimensions")
        if dimensions > self.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be at most the model's embedding size {self.hidden_size}, "
                f"got {dimensions}", "dimensions")


def _st_pooling(model_dir: Path) -> tuple[str | None, bool | None, str]:
    """(pooling type, normalise, source) from sentence-transformers' files; None where they
    say nothing."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None, None, ""
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{modules_file}: not readable as JSON ({e})", "model") from None
    pooling_type, normalize = None, False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
            continue
        if kind != "Pooling":
            raise ConfigError(
                f"{modules_file}: the module {kind!r} ({m.get('path')}) is not served here; "
                "iterserve pools as sentence-transformers' Transformer -> Pooling -> "
                "Normalize, and leaving a module out would change the vectors", "model")
        cfg_file = model_dir / str(m.get("path", "")) / "config.json"
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{cfg_file}: the pooling config is not readable ({e})",
                              "model") from None
        modes = cfg.get("pooling_mode")
        if modes is not None:
            modes = [modes] if isinstance(modes, str) else list(modes)
            types = [_ST_MODES.get(str(x), str(x).upper()) for x in modes]
        else:
            types = [t for k, t in _ST_FLAGS.items() if cfg.get(k)]
        if len(types) != 1 or types[0] not in POOLING_TYPES:
            raise ConfigError(f"{cfg_file}: pooling {types or 'none'} is not served here "
                              f"(one of {', '.join(POOLING_TYPES)})", "model")
        pooling_type = types[0]
    return pooling_type, normalize, str(modules_file)


def _renders_messages(model_dir: Path) -> bool:
    """sentence-transformers (6.x) saves a `message` modality for a tokenizer with a chat
    template, and then encodes text as a chat message."""
    f = model_dir / "sentence_bert_config.json"
    try:
        cfg = json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return False
    return "message" in (cfg.get("modality_config") or {})


def read_pooler_config(model_path: str | None, hf_config: dict[str, Any], hidden_size: int,
                       override: dict[str, Any] | None = None) -> PoolerConfig:
    """The model's pooling: sentence-transformers' files beside the weights, else the last
    token normalised; `override` (--pooler-config) wins key by key."""
    ptype, normalize, source = None, None, ""
    o = dict(override or {})
    if model_path is not None and Path(model_path).is_dir():
        ptype, normalize, source = _st_pooling(Path(model_path))
        if source and not o and _renders_messages(Path(model_path)):
            raise ConfigError(
                f"{model_path}/sentence_bert_config.json: sentence-transformers renders this "
                "checkpoint's inputs through its chat template (a 'message' modality), which "
                "the embedding path does not do, so the vectors would differ; give "
                "--pooler-config to serve its raw text anyway", "model")
    if "pooling_type" in o:
        ptype, source = str(o["pooling_type"]).upper(), "--pooler-config"
        if ptype not in POOLING_TYPES:
            raise ConfigError(f"--pooler-config: pooling_type {o['pooling_type']!r} is not one "
                              f"of {', '.join(POOLING_TYPES)}", "pooler_config")
    if "normalize" in o:
        normalize, source = bool(o["normalize"]), source or "--pooler-config"
    dims = hf_config.get("matryoshka_dimensions")
    return PoolerConfig(
        pooling_type=ptype or "LAST", normalize=True if normalize is None else normalize,
        hidden_size=hidden_size,
        is_matryoshka=bool(hf_config.get("is_matryoshka")) or bool(dims),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        source=source or PoolerConfig.source)


@dataclass(slots=True)
class PoolState:
    """One request's pooling across its chunks."""

    acc: torch.Tensor | None = None      # MEAN: sum of rows; MAX: max; CLS: row 0; LAST
    count: int = 0                       # rows seen


class Pooler:
    """Turns a request's hidden rows, chunk by chunk, into its vector."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def add(self, state: PoolState, rows: torch.Tensor, start: int) -> None:
        """A chunk's rows (final-normed hidden states of prompt positions start..)."""
        t = self.config.pooling_type
        rows = rows.float()
        if t in ("MEAN", "MEAN_SQRT_LEN"):
            s = rows.sum(0)
            state.acc = s if state.acc is None else state.acc + s
        elif t == "MAX":
            m = rows.amax(0)
            state.acc = m if state.acc is None else torch.maximum(state.acc, m)
        elif t == "CLS" and start == 0:
            state.acc = rows[0].clone()
        elif t == "LAST":
            state.acc = rows[-1].clone()
        state.count += rows.shape[0]

    def finish(self, state: PoolState, dimensions: int | None, normalize: bool | None
               ) -> torch.Tensor:
        """The vector: pooled, cut to `dimensions` (Matryoshka), then normalised (L2) when
        the request or the model says so; float32 on the CPU."""
        t = self.config.pooling_type
        v = state.acc
        if t == "MEAN":
            v = v / state.count
        elif t == "MEAN_SQRT_LEN":
            v = v / (state.count ** 0.5)
        if dimensions is not None:
            v = v[:dimensions]
        if self.config.normalize if normalize is None else normalize:
            v = torch.nn.functional.normalize(v, p=2, dim=-1)
        return v.to("cpu", torch.float32)
