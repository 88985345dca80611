"""How long one simulated step takes, so the lab can report seconds as well as steps.

It sits in core because the scheduler's slo policy seeds its online step-time model from it
(core/step_time.py); the lab prices its simulated steps with it.

The lab counts in scheduler steps; a cost model turns each step's batch into seconds. The
model is linear in what a forward pass costs on a GPU or CPU, plus the engine's own time
around it:

    step_s = c0                         fixed per step (weights read once, kernel launches)
           + c_tok * tokens_in_step      every token computed (prefill chunks and decodes)
           + c_seq * seqs_in_step        per scheduled sequence (sampling, bookkeeping)
           + c_kv * kv_tokens_read       K/V positions attention reads, summed over sequences
           + c_prefill_tok * prefill_tokens   extra cost of prompt tokens, if any
           + c_attn * attn_pairs         query-key pairs of prefill chunks: sum over chunks of
                                         chunk_tokens * (context before it + chunk_tokens)
           + overhead_s + overhead_seq_s * seqs_in_step   the serving loop outside the
                                         model runner (scheduling, output processing,
                                         detokenisation), per step and per sequence

         + corr(tokens)                  a piecewise-linear correction by the step's token
                                         count (`token_corrections`), proportional to the
                                         tokens beyond the last knot, clamped so a step
                                         never costs less than a tenth of the linear terms

Why `corr(tokens)`: the model runner's GEMMs change kernel with the number of rows a step
puts through them (on CPU: the decode kernels up to `QUANT_MAX_ROWS` rows, a panel GEMM
above; int8 kernels that work in groups of rows), so a 16-token prefill chunk costs what 16
decodes cost, not a 16th of a 256-token chunk, and 4 rows can cost what 2 do. No linear term
can say that; a correction read off at the token counts the calibration timed (linear
between them, the first value held below them, a per-token rate beyond the last: see
`core.step_time.token_correction`, the one definition the SLO policy's online model uses
too, so its predictions and the lab's simulated steps are the same function of a step).

Why `c_attn`: a decode reads its context once (`c_kv`), but every token of a prefill chunk
attends to the whole context, so a 128-token chunk at context 1,500 costs far more than the
same chunk at context 0 (measured on the runner: 220 ms vs 132 ms with 16 decodes, where
the linear terms said 139 ms for both). Why the overhead terms: the model runner is what
`lab calibrate` times, but a client waits for the whole engine step; the calibration measures
the rest on a short run of the real engine (`overhead_*`), so the lab's seconds are the
engine's wall clock, not the runner's.

A step with nothing scheduled (waiting for the next arrival) takes `idle_step_s`.

File format (JSON object, all times in seconds; unknown keys are an error so a typo cannot
silently fall back to a default):

    {"format": "iterserve-lab-cost-model", "version": 3,
     "description": "free text: what the numbers were fitted on",
     "c0": 0.010, "c_tok": 7e-05, "c_seq": 2e-05, "c_kv": 3.5e-07,
     "c_prefill_tok": 0.0, "c_attn": 1e-9, "overhead_s": 4e-4, "overhead_seq_s": 5e-5,
     "idle_step_s": 0.010, "token_corrections": [[1, 0.0], [16, 0.004], [33, -0.002]]}

`token_corrections` (version 3) is a list of [tokens, seconds] pairs, tokens strictly
increasing, seconds of either sign.

`format`, `version`, `description` and `source` are optional; missing coefficients are 0
(`idle_step_s` defaults to `c0`), so a version-1 file (no `c_attn`, no overhead) or a
version-2 file (no corrections) loads and
means what it meant. The shipped default (core/data/default_cost_model.json) is
an order-of-magnitude guess for a 7B fp16 model on one A100-class GPU; fitting it to the real
model runner is `iterserve lab calibrate`'s job, which writes this format.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from iterserve.core.step_time import COEFFICIENTS, MIN_LINEAR_SHARE, token_correction
from iterserve.errors import CostModelError

FORMAT = "iterserve-lab-cost-model"
VERSION = 3
VERSIONS = (1, 2, 3)         # readable; version 1 files lack c_attn and the overhead terms,
                             # versions 1 and 2 the token corrections
# The model runner's coefficients are step_time's COEFFICIENTS (what `lab calibrate` fits to
# ModelRunner.execute); the serving loop around the runner adds these (fitted to a short run
# of the real engine).
OVERHEADS = ("overhead_s", "overhead_seq_s")
_META_KEYS = ("format", "version", "description", "source")
CORRECTIONS = "token_corrections"


def check_corrections(value: Any) -> tuple[tuple[int, float], ...]:
    """A `token_corrections` value as ((tokens, seconds), ...); errors say what is wrong."""
    if not isinstance(value, (list, tuple)):
        raise CostModelError(f"{CORRECTIONS} must be a list of [tokens, seconds] pairs")
    out: list[tuple[int, float]] = []
    for item in value:
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or isinstance(item[0], bool) or not isinstance(item[0], int) or item[0] < 1
                or isinstance(item[1], bool) or not isinstance(item[1], (int, float))
                or not math.isfinite(item[1])):
            raise CostModelError(f"{CORRECTIONS}: each entry must be [tokens >= 1, finite "
                                 f"seconds], got {item!r}")
        if out and item[0] <= out[-1][0]:
            raise CostModelError(f"{CORRECTIONS}: token counts must be strictly increasing, "
                                 f"got {item[0]} after {out[-1][0]}")
        out.append((int(item[0]), float(item[1])))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class CostModel:
    c0: float = 0.0
    c_tok: float = 0.0
    c_seq: float = 0.0
    c_kv: float = 0.0
    c_prefill_tok: float = 0.0
    c_attn: float = 0.0
    overhead_s: float = 0.0
    overhead_seq_s: float = 0.0
    idle_step_s: float = 0.0
    description: str = ""
    token_corrections: tuple[tuple[int, float], ...] = ()

    def step_time(self, tokens: int, seqs: int, kv_tokens_read: int,
                  prefill_tokens: int = 0, attn_pairs: int = 0) -> float:
        """Seconds one engine step takes (runner + serving overhead); an empty step
        (seqs == 0) takes `idle_step_s`."""
        if seqs == 0:
            return self.idle_step_s
        return (self.runner_time(tokens, seqs, kv_tokens_read, prefill_tokens, attn_pairs)
                + self.overhead_s + self.overhead_seq_s * seqs)

    def runner_time(self, tokens: int, seqs: int, kv_tokens_read: int,
                    prefill_tokens: int = 0, attn_pairs: int = 0) -> float:
        """Seconds of the model runner alone (what `lab calibrate` times), no overhead."""
        linear = (self.c0 + self.c_tok * tokens + self.c_seq * seqs
                  + self.c_kv * kv_tokens_read + self.c_prefill_tok * prefill_tokens
                  + self.c_attn * attn_pairs)
        if not self.token_corrections:
            return linear
        return max(linear + self.correction(tokens), MIN_LINEAR_SHARE * linear)

    def correction(self, tokens: float) -> float:
        """corr(tokens) (`core.step_time.token_correction`): linear between the
        corrections' token counts, the first value held below them, proportional to the
        tokens beyond the last; 0 without corrections."""
        return token_correction(self.token_corrections, tokens)

    def linear_equivalent(self) -> "CostModel":
        """This model without token corrections: the linear terms refitted (non-negative
        least squares on relative error) to its own predictions over the shapes an engine
        runs (decodes of 1-32 rows at 64-1k of context, chunks of 16-512 tokens at context
        0-1.5k, mixed steps). What reads only the linear terms gets the closest linear model,
        not the linear part of a joint fit (which leans on the corrections). Itself
        without corrections. The SLO policy's online model carries the corrections now
        (core/step_time.py); this is for a shipped fit that must stay linear (see
        lab/slo.py: the SLO goodput preset's targets assume a step time linear in the
        batch)."""
        if not self.token_corrections:
            return self
        # numpy (core/fit.py) only to refit: the scheduler and the lab never load it
        from iterserve.core.fit import GridPoint, fit_coefficients

        shapes = [GridPoint(d, kv) for d in (1, 2, 4, 8, 16, 32) for kv in (64, 256, 1024)]
        shapes += [GridPoint(prefill_tokens=p, prefill_chunks=1, prefill_context=c)
                   for p in (16, 64, 128, 256, 512) for c in (0, 512, 1536)]
        shapes += [GridPoint(d, 256, prefill_tokens=p, prefill_chunks=1)
                   for d in (4, 8) for p in (16, 32, 128)]
        feats = [p.features() for p in shapes]
        coef = fit_coefficients(feats, [self.runner_time(*f) for f in feats])
        d = self.to_dict()
        d.pop(CORRECTIONS)
        d.update(coef)
        return CostModel.from_dict(d)

    @classmethod
    def from_dict(cls, data: Any) -> "CostModel":
        if not isinstance(data, dict):
            raise CostModelError(f"cost model must be a JSON object, got {type(data).__name__}")
        numeric = COEFFICIENTS + OVERHEADS + ("idle_step_s",)
        allowed = set(numeric) | set(_META_KEYS) | {CORRECTIONS}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise CostModelError(
                f"unknown key(s) {', '.join(map(repr, unknown))}; "
                f"expected some of {', '.join(numeric)}")
        if "format" in data and data["format"] != FORMAT:
            raise CostModelError(f"format must be {FORMAT!r}, got {data['format']!r}")
        if "version" in data and (isinstance(data["version"], bool)
                                  or data["version"] not in VERSIONS):
            raise CostModelError(f"version must be one of {', '.join(map(str, VERSIONS))}, "
                                 f"got {data['version']!r}")
        values: dict[str, float] = {}
        for key in numeric:
            if key not in data:
                continue
            v = data[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise CostModelError(f"{key} must be a finite number, got {v!r}")
            if v < 0:
                raise CostModelError(f"{key} must be non-negative, got {v}")
            values[key] = float(v)
        values.setdefault("idle_step_s", values.get("c0", 0.0))
        description = data.get("description", "")
        if not isinstance(description, str):
            raise CostModelError("description must be a string")
        corrections = check_corrections(data.get(CORRECTIONS, ()))
        return cls(description=description, token_corrections=corrections, **values)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        if self.description:
            d["description"] = self.description
        for key in COEFFICIENTS + OVERHEADS + ("idle_step_s",):
            d[key] = getattr(self, key)
        if self.token_corrections:
            d[CORRECTIONS] = [[t, v] for t, v in self.token_corrections]
        return d


def shipped_cost_models() -> list[str]:
    """Names of the cost models shipped in core/data (file names without `.json`)."""
    return sorted(p.name[:-5] for p in resources.files("iterserve.core").joinpath("data").iterdir()
                  if p.name.endswith(".json"))


def shipped_cost_model(name: str) -> CostModel:
    """A shipped cost model by name (see `shipped_cost_models`), never a path."""
    text = resources.files("iterserve.core").joinpath(f"data/{name}.json").read_text(
        encoding="utf-8")
    return CostModel.from_dict(json.loads(text))


def load_cost_model(path: str | Path) -> CostModel:
    """Read a cost-model JSON file, or a shipped one by name (e.g. "smollm2-cpu", see
    `shipped_cost_models`) when no such file exists; errors name the file."""
    p = Path(path)
    name = str(path)
    if not p.exists() and "/" not in name and name in shipped_cost_models():
        return shipped_cost_model(name)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        hint = ""
        if "/" not in name and not name.endswith(".json"):
            hint = f" (shipped cost models: {', '.join(shipped_cost_models())})"
        raise CostModelError(
            f"cannot read cost model {name!r}: {e.strerror or e}{hint}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CostModelError(f"cost model {str(path)!r} is not valid JSON: {e}") from e
    try:
        return CostModel.from_dict(data)
    except CostModelError as e:
        raise CostModelError(f"cost model {str(path)!r}: {e}") from e


def default_cost_model() -> CostModel:
    """The shipped default (see the module docstring for what it stands for)."""
    return shipped_cost_model("default_cost_model")
