"""Every environment variable iterserve reads or sets, declared once (as vLLM's envs.py).

A setting that a user chooses per run is a knob (core/config.py), with a flag. A variable is
for what has to be known outside any command's flags: where the native kernels are built and
with which compiler, a switch that turns a code path off for a comparison, and the OpenMP
variables that libgomp itself reads when torch loads it (so they must be in the environment
before that). Each is declared here with its type, its default and what it does; the product
reads and sets them only through this module (tests/test_envs.py fails on an `os.environ` or
`os.getenv` anywhere else in src/), and README.md's "Environment variables" lists them.

    from iterserve import envs
    envs.ITERSERVE_NATIVE_KERNELS        # parsed at each access: a test may set it and reload
    envs.get("OMP_WAIT_POLICY", env)     # the same, from a given mapping
    envs.export("OMP_NUM_THREADS", 4)

An empty value counts as unset (`CC= iterserve serve` uses the default compiler). torch-free
and import-free on purpose: any layer may read a variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

_FALSE = ("0", "false", "no", "off")


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in _FALSE


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable: its name, how its text becomes a value, its default, what it does."""

    name: str
    kind: str                        # "bool" (0/false/no/off: false), "path" or "str"
    default: Any
    help: str
    read_by: str                     # who reads it: the module, or a library

    def parse(self, raw: str | None) -> Any:
        if raw is None or raw == "":
            return self.default
        return _PARSERS[self.kind](raw)


_PARSERS: dict[str, Callable[[str], Any]] = {"bool": _flag, "path": str, "str": str}

VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("ITERSERVE_NATIVE_KERNELS", "bool", True,
           "0 turns the native C kernels off: the model runs its pure-torch path (the "
           "numerical reference)", "model/kernels"),
    EnvVar("ITERSERVE_PREFILL_ATTENTION", "bool", True,
           "0 keeps prompt chunks on the torch attention path (index_select + SDPA) while "
           "the other native kernels stay on", "model/attention.py"),
    EnvVar("ITERSERVE_CACHE_DIR", "path", None,
           "where the native kernels are built and cached (its kernels/ folder; default "
           "$XDG_CACHE_HOME/iterserve, else ~/.cache/iterserve)", "model/kernels"),
    EnvVar("XDG_CACHE_HOME", "path", None,
           "the user's cache root, used when ITERSERVE_CACHE_DIR is unset", "model/kernels"),
    EnvVar("CC", "str", None,
           "the C compiler that builds the native kernels (default: cc, else gcc, from PATH)",
           "model/kernels"),
    EnvVar("OMP_WAIT_POLICY", "str", None,
           "what idle OpenMP threads do (ACTIVE spins, PASSIVE sleeps); read by libgomp when "
           "torch loads it; when set it wins over --omp-wait-policy, which otherwise sets it",
           "libgomp; engine/omp_policy.py"),
    EnvVar("OMP_NUM_THREADS", "str", None,
           "OpenMP threads of the process; read by libgomp when torch loads it; each data-"
           "parallel replica gets --threads-per-replica", "libgomp; replicas/"),
    EnvVar("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "str", None,
           "Ray's single-node switch: iterserve sets it to 0 when it starts a local Ray "
           "cluster (-dp N without --ray-address), so every Ray server binds 127.0.0.1; "
           "read by Ray and by its processes", "ray; replicas/"),
)}


def _declared(name: str) -> EnvVar:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in iterserve/envs.py") from None


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of a declared variable, from `env` (default: this process's environment)."""
    return _declared(name).parse((os.environ if env is None else env).get(name))


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether a declared variable has a non-empty value."""
    _declared(name)
    return bool((os.environ if env is None else env).get(name))


def export(name: str, value: Any) -> None:
    """Set a declared variable for this process and the processes it starts."""
    _declared(name)
    os.environ[name] = str(value)


def __getattr__(name: str) -> Any:
    """`envs.NAME`: the variable's current value (read at each access, as vLLM's envs)."""
    if name in VARIABLES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(VARIABLES))


def describe() -> str:
    """The variables as a table (README.md's list is checked against this registry)."""
    lines = []
    for v in VARIABLES.values():
        default = "unset" if v.default is None else ("1" if v.default is True else v.default)
        lines.append(f"{v.name} ({v.kind}, default {default}; {v.read_by}): {v.help}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
