"""What the lab asks the scheduler to serve: output lengths, prompt lengths, arrivals, classes.

The answer lengths are what the scheduler cannot know in advance; the reference mix is 80%
short answers (10-100 tokens) and 20% long ones (250-500). Each random quantity has its own
random stream derived from the seed, so turning on prompts, arrivals or priorities does not
change the output lengths drawn for the same seed (the reference case stays comparable).

Arrivals are in steps: with `arrival_rate` R (requests per step) the gaps are exponential
with mean 1/R (a Poisson process); a request arriving at continuous time t is visible to the
scheduler from the start of step floor(t). Without a rate every request arrives at step 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from iterserve.errors import WorkloadError


MAX_LENGTH = 100_000      # one request's output or prompt length (keeps the lab interactive)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    arrival: int            # step the request arrives in
    prompt_len: int         # 1 when prefill is ignored
    output_len: int
    long: bool
    priority: int           # 0 = urgent class, 1 = normal (lower is more urgent, as in vLLM)
    arrival_s: float | None = None   # with arrival_rate_s: arrival in simulated seconds (the
                                     # request is visible from the first step starting after)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    requests: int = 48
    seed: int = 0
    short_frac: float = 0.8
    short: tuple[int, int] = (10, 100)
    long: tuple[int, int] = (250, 500)
    lengths: tuple[int, ...] | None = None          # given lengths instead of drawing them
    arrival_rate: float | None = None               # requests per step; None = all at step 0
    prompt_len: tuple[int, int] | None = None       # None = prefill ignored (1-token prompts)
    priority_frac: float = 0.0                      # share of requests in the urgent class
    long_prompt_frac: float = 0.0                   # share of prompts drawn from long_prompt
    long_prompt: tuple[int, int] | None = None      # (the "longprompt" mix)
    arrival_rate_s: float | None = None             # requests per simulated second (Poisson)


def _rng(seed: int, stream: str) -> random.Random:
    # The lengths stream uses the bare seed so the reference draw depends on nothing else.
    return random.Random(seed if stream == "lengths" else f"{seed}:{stream}")


def draw_workload(spec: WorkloadSpec) -> list[RequestSpec]:
    """The requests of one experiment, in arrival order (ties in index order)."""
    if spec.lengths is not None:
        lengths = list(spec.lengths)
        longs = [n > spec.short[1] for n in lengths]
    else:
        rng = _rng(spec.seed, "lengths")
        lengths, longs = [], []
        for _ in range(spec.requests):
            is_long = rng.random() >= spec.short_frac
            lo, hi = spec.long if is_long else spec.short
            lengths.append(rng.randint(lo, hi))
            longs.append(is_long)
    n = len(lengths)

    if spec.prompt_len is None:
        prompts = [1] * n
    else:
        rng = _rng(spec.seed, "prompts")
        lo, hi = spec.prompt_len
        prompts = [rng.randint(lo, hi) for _ in range(n)]
        if spec.long_prompt_frac > 0 and spec.long_prompt is not None:
            # Its own stream, so the short prompts above are the same with or without it.
            rng = _rng(spec.seed, "long_prompts")
            llo, lhi = spec.long_prompt
            prompts = [rng.randint(llo, lhi) if rng.random() < spec.long_prompt_frac else p
                       for p in prompts]

    arrivals_s: list[float | None] = [None] * n
    if spec.arrival_rate_s is not None:
        # Poisson in simulated seconds (what an SLO experiment needs: a rate per step would
        # slow down with the steps). The step a request arrives in is set by the simulator.
        rng = _rng(spec.seed, "arrivals")
        t, arrivals = 0.0, [0] * n
        for i in range(n):
            t += rng.expovariate(spec.arrival_rate_s)
            arrivals_s[i] = t
    elif spec.arrival_rate is None:
        arrivals = [0] * n
    else:
        rng = _rng(spec.seed, "arrivals")
        t, arrivals = 0.0, []
        for _ in range(n):
            t += rng.expovariate(spec.arrival_rate)
            arrivals.append(int(t))

    if spec.priority_frac > 0:
        rng = _rng(spec.seed, "priority")
        priorities = [0 if rng.random() < spec.priority_frac else 1 for _ in range(n)]
    else:
        priorities = [0] * n

    return [RequestSpec(i, arrivals[i], prompts[i], lengths[i], longs[i], priorities[i],
                        arrivals_s[i]) for i in range(n)]


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'10-100' -> (10, 100); a single number N means N-N. Errors name the option."""
    s = str(text).strip()
    parts = s.split("-") if "-" in s[1:] else [s]
    if len(parts) == 2 and parts[0] == "":       # a leading minus: '-5-10'
        parts = [s]
    try:
        values = [int(p.strip()) for p in parts]
    except ValueError:
        raise WorkloadError(f"{name}: expected MIN-MAX with integers (e.g. 10-100), got {text!r}")
    if len(values) == 1:
        values = values * 2
    if len(values) != 2:
        raise WorkloadError(f"{name}: expected MIN-MAX with integers (e.g. 10-100), got {text!r}")
    return check_range(values, name)


def check_range(values, name: str, minimum: int = 1) -> tuple[int, int]:
    if (not isinstance(values, (list, tuple)) or len(values) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in values)):
        raise WorkloadError(f"{name}: expected [min, max] with two integers, got {values!r}")
    lo, hi = values
    if lo < minimum:
        raise WorkloadError(f"{name}: minimum must be at least {minimum}, got {lo}")
    if hi < lo:
        raise WorkloadError(f"{name}: maximum {hi} is below minimum {lo}")
    if hi > MAX_LENGTH:
        raise WorkloadError(f"{name}: maximum must be at most {MAX_LENGTH}, got {hi}")
    return lo, hi


def check_lengths(lengths, name: str = "lengths") -> tuple[int, ...]:
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise WorkloadError(f"{name}: expected a non-empty list of output lengths")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int):
            raise WorkloadError(f"{name}[{i}]: expected an integer, got {n!r}")
        if n < 1:
            raise WorkloadError(f"{name}[{i}]: an output length must be at least 1, got {n}")
        if n > MAX_LENGTH:
            raise WorkloadError(f"{name}[{i}]: an output length must be at most {MAX_LENGTH}, got {n}")
    return tuple(lengths)


def read_lengths_file(path: str | Path) -> tuple[int, ...]:
    """One output length per line; blank lines and '#' comments are ignored.

    Errors name the file and the line ('lengths.txt:3: ...').
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise WorkloadError(f"{path}: not a UTF-8 text file")
    except OSError as e:
        raise WorkloadError(f"cannot read lengths file {str(path)!r}: {e.strerror or e}") from e
    lengths: list[int] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            n = int(line)
        except ValueError:
            raise WorkloadError(f"{path}:{lineno}: expected one integer output length, got {line!r}")
        if n < 1:
            raise WorkloadError(f"{path}:{lineno}: an output length must be at least 1, got {n}")
        if n > MAX_LENGTH:
            raise WorkloadError(f"{path}:{lineno}: an output length must be at most {MAX_LENGTH}, got {n}")
        lengths.append(n)
    if not lengths:
        raise WorkloadError(f"{path}: no output lengths found (one integer per line)")
    return tuple(lengths)


def mean_length(spec: WorkloadSpec) -> float:
    """Expected output length of the drawn mix (used to pick defaults, not for results)."""
    if spec.lengths is not None:
        return sum(spec.lengths) / len(spec.lengths)
    s = (spec.short[0] + spec.short[1]) / 2
    lg = (spec.long[0] + spec.long[1]) / 2
    return spec.short_frac * s + (1 - spec.short_frac) * lg


__all__ = ["RequestSpec", "WorkloadSpec", "WorkloadError", "draw_workload", "parse_range",
           "check_range", "check_lengths", "read_lengths_file", "MAX_LENGTH"]


# --- Shared-prefix workloads (the cluster lab) --------------------------------------------
# Many requests open with one of a few long system prompts (a chat product's instructions, a
# RAG template, few-shot examples), then a question of their own. That is the workload a
# prefix-aware router is for: sending a group's requests to the replica that already holds
# its prefix in the KV cache saves the prefill. Token ids are made up but distinct: group
# g's prefix is PREFIX_TOKEN_BASE + g repeated, request i's own tokens are
# UNIQUE_TOKEN_BASE + i, so two prompts share exactly their group's prefix blocks.
PREFIX_TOKEN_BASE = 1_000
UNIQUE_TOKEN_BASE = 10_000_000


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    groups: int             # distinct shared prefixes (system prompts)
    prefix_len: int         # tokens in each, added in front of the drawn prompt
    zipf: float = 0.0       # 0: groups equally likely; s > 0: weight 1 / (g + 1)^s


def draw_prefix_groups(n: int, shared: SharedPrefixSpec, seed: int) -> list[int]:
    """Each request's prefix group (its own random stream, so lengths and arrivals stay
    those of the same seed without prefixes)."""
    rng = _rng(seed, "prefix_groups")
    if shared.zipf > 0:
        weights = [1.0 / (g + 1) ** shared.zipf for g in range(shared.groups)]
        return rng.choices(range(shared.groups), weights=weights, k=n)
    return [rng.randrange(shared.groups) for _ in range(n)]


def with_shared_prefix(specs: list[RequestSpec], shared: SharedPrefixSpec,
                       seed: int) -> tuple[list[RequestSpec], list[int]]:
    """`specs` with each prompt lengthened by its group's prefix, and the groups (by index)."""
    from dataclasses import replace

    groups = draw_prefix_groups(len(specs), shared, seed)
    out = [replace(s, prompt_len=s.prompt_len + shared.prefix_len) for s in specs]
    return out, [groups[s.index] for s in specs]


def prompt_token_ids(spec: RequestSpec, group: int, prefix_len: int) -> list[int]:
    """The prompt of one request: its group's prefix (group >= 0), then its own tokens."""
    if group < 0 or prefix_len <= 0:
        return [UNIQUE_TOKEN_BASE + spec.index] * spec.prompt_len
    return ([PREFIX_TOKEN_BASE + group] * prefix_len
            + [UNIQUE_TOKEN_BASE + spec.index] * (spec.prompt_len - prefix_len))


__all__ += ["SharedPrefixSpec", "draw_prefix_groups", "with_shared_prefix", "prompt_token_ids",
            "PREFIX_TOKEN_BASE", "UNIQUE_TOKEN_BASE"]
