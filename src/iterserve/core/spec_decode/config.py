"""`--speculative-config`: vLLM's JSON, parsed and checked once, into plain data.

The keys are vLLM's (`method`, `num_speculative_tokens`, `prompt_lookup_min/max`, `model`,
`suffix_decoding_*`), so a pasted `vllm serve ... --speculative-config '{...}'` works; a few
are this engine's own and say so below. Every error is a ConfigError naming the key, raised
at start (the knob is checked with the other scheduler knobs in core/config.py).

Methods:

- `ngram`: prompt lookup over the request's own tokens (the longest n-gram of the last
  `prompt_lookup_min..max` tokens that occurred before; what followed it is proposed).
- `suffix`: suffix decoding (Arctic Inference's, vLLM's `suffix`): the longest suffix of the
  context found in the request's own tokens or in recent requests' outputs; continuations
  chosen by frequency, as many as the match is long (`suffix_decoding_max_spec_factor`),
  cut where a continuation's share drops below `suffix_decoding_min_token_prob`.
- `draft_model`: a smaller model with the same vocabulary (`model`: any file or directory
  iterserve loads) proposes greedily (model/draft.py); its KV lives in a pool of its own
  indexed by the target's block tables, so the one block manager books both.
- `synthetic`: for benchmarks on random-weight models, as llama-server's
  `--spec-synth-rates`: draft j is accepted with the unconditional probability
  `acceptance_rates[j]` (non-increasing), whatever the target computes, so a step costs
  what a real verification costs and the output is not the model's.

This engine's own keys: `adaptive` (default true: the number of drafts per request adapts to
its recent acceptance and to what a token costs at the step's batch size, so speculation
turns itself off where it would be a loss; false verifies every proposal, up to
`num_speculative_tokens`), `cost_model` (the step-time fit it starts from, a shipped name or
a JSON file, refitted online: default `smollm2-cpu`), `acceptance_rates` (synthetic).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

METHODS = ("ngram", "suffix", "draft_model", "synthetic")
# vLLM's keys this engine takes but that change nothing here (logged at start by the caller).
NO_EFFECT_KEYS = ("disable_log_stats", "disable_logprobs", "draft_tensor_parallel_size",
                  "quantization", "revision", "code_revision", "max_model_len",
                  "disable_padded_drafter_batch", "enforce_eager")
MAX_SPECULATIVE_TOKENS = 32


class SpeculativeConfigError(ValueError):
    """A bad `speculative_config`; `key` is the offending key (core/config.py turns it into
    a ConfigError naming the knob)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    acceptance_rates: tuple[float, ...] = ()
    adaptive: bool = True
    cost_model: str | None = None
    ignored: tuple[str, ...] = field(default=(), compare=False)   # NO_EFFECT_KEYS given

    @property
    def executor_proposes(self) -> bool:
        """Drafts come from the executor (a draft model), not from the scheduler's side."""
        return self.method == "draft_model"

    def to_dict(self) -> dict[str, Any]:
        """The config with every default filled in (parses back to an equal config)."""
        d = asdict(self)
        d.pop("ignored")
        d["acceptance_rates"] = list(self.acceptance_rates)
        return {k: v for k, v in d.items() if v is not None and v != []}

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """From a dict, a JSON object string or a SpeculativeConfig; None for None / {}."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpeculativeConfigError(
                    f"must be a JSON object, e.g. '{{\"method\": \"ngram\", "
                    f"\"num_speculative_tokens\": 4}}': {e.msg} at character {e.pos}") from None
        if not isinstance(value, Mapping):
            raise SpeculativeConfigError(f"must be an object, got {type(value).__name__}")
        if not value:
            return None
        return _from_mapping(dict(value))


def _int(d: dict, key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = d.pop(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpeculativeConfigError(f"{key} must be an integer, got {v!r}", key)
    if v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f"at least {lo}"
        raise SpeculativeConfigError(f"{key} must be {bound}, got {v}", key)
    return v


def _float(d: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = d.pop(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not lo <= v <= hi:
        raise SpeculativeConfigError(f"{key} must be a number in [{lo:g}, {hi:g}], got {v!r}",
                                     key)
    return float(v)


def _from_mapping(d: dict) -> SpeculativeConfig:
    method = d.pop("method", None)
    model = d.pop("model", None)
    if model is not None and not (isinstance(model, str) and model):
        raise SpeculativeConfigError(f"model must be a path, got {model!r}", "model")
    if method is None:
        # vLLM infers the method from the model when only a model is given.
        if model is None:
            raise SpeculativeConfigError(
                f"method is required (one of {', '.join(METHODS)})", "method")
        method = "draft_model"
    if method not in METHODS:
        raise SpeculativeConfigError(
            f"method must be one of {', '.join(METHODS)}; got {method!r} (EAGLE, MTP and "
            "Medusa heads need trained weights this engine does not load)", "method")
    if method == "draft_model" and model is None:
        raise SpeculativeConfigError("method draft_model needs model (the draft's file or "
                                     "directory)", "model")
    if method != "draft_model" and model is not None:
        raise SpeculativeConfigError(f"model is for method draft_model, not {method}", "model")
    k = _int(d, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    rates_in = d.pop("acceptance_rates", None)
    rates: tuple[float, ...] = ()
    if rates_in is not None:
        if method != "synthetic":
            raise SpeculativeConfigError("acceptance_rates is for method synthetic",
                                         "acceptance_rates")
        if not isinstance(rates_in, (list, tuple)) or not rates_in or any(
                isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)
                or not 0 <= r <= 1 for r in rates_in):
            raise SpeculativeConfigError(
                "acceptance_rates must be a non-empty list of probabilities in [0, 1]",
                "acceptance_rates")
        rates = tuple(float(r) for r in rates_in)
        if any(b > a for a, b in zip(rates, rates[1:])):
            raise SpeculativeConfigError(
                "acceptance_rates are unconditional per-position probabilities (as "
                "llama-server's --spec-synth-rates) and must not increase", "acceptance_rates")
        if k is None:
            k = len(rates)
        elif k != len(rates):
            raise SpeculativeConfigError(
                f"acceptance_rates has {len(rates)} values for num_speculative_tokens {k}",
                "acceptance_rates")
    elif method == "synthetic":
        raise SpeculativeConfigError("method synthetic needs acceptance_rates (one "
                                     "probability per draft position)", "acceptance_rates")
    if k is None:
        raise SpeculativeConfigError("num_speculative_tokens is required", "num_speculative_tokens")
    lo = _int(d, "prompt_lookup_min", None, 1, 1024)
    hi = _int(d, "prompt_lookup_max", None, 1, 1024)
    if lo is None and hi is None:
        lo = hi = 5                      # vLLM's choice when neither is given
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    if lo > hi:
        raise SpeculativeConfigError(
            f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})",
            "prompt_lookup_min")
    depth = _int(d, "suffix_decoding_max_tree_depth", 24, 1, 1024)
    cached = _int(d, "suffix_decoding_max_cached_requests", 1000, 0, 1_000_000)
    factor = _float(d, "suffix_decoding_max_spec_factor", 1.0, 0.0, 1000.0)
    min_prob = _float(d, "suffix_decoding_min_token_prob", 0.1, 0.0, 1.0)
    adaptive = d.pop("adaptive", True)
    if not isinstance(adaptive, bool):
        raise SpeculativeConfigError(f"adaptive must be true or false, got {adaptive!r}",
                                     "adaptive")
    cost_model = d.pop("cost_model", None)
    if cost_model is not None and not (isinstance(cost_model, str) and cost_model):
        raise SpeculativeConfigError(f"cost_model must be a shipped fit's name or a JSON "
                                     f"file, got {cost_model!r}", "cost_model")
    ignored = tuple(sorted(key for key in list(d) if key in NO_EFFECT_KEYS))
    for key in ignored:
        d.pop(key)
    if d:
        unknown = sorted(d)
        raise SpeculativeConfigError(
            f"unknown key(s) {', '.join(map(repr, unknown))}; known: method, "
            "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, "
            "suffix_decoding_max_tree_depth, suffix_decoding_max_cached_requests, "
            "suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob, "
            "acceptance_rates, adaptive, cost_model", unknown[0])
    return SpeculativeConfig(
        method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
        model=model, suffix_decoding_max_tree_depth=depth,
        suffix_decoding_max_cached_requests=cached, suffix_decoding_max_spec_factor=factor,
        suffix_decoding_min_token_prob=min_prob, acceptance_rates=rates, adaptive=adaptive,
        cost_model=cost_model, ignored=ignored)
