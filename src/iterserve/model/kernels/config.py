"""The kernels' one configuration: `KernelConfig`, set once per process by `configure`.

Why one: the activation mode and the instruction sets are what decide which kernel a linear
layer runs (dispatch.c's table) and so what numbers it computes, so they are decided in one
place and never read from the environment by a kernel. The engine (and each
tensor-parallel rank process) calls `configure(KernelConfig(...))` before the model
loads, the library resolves it against the CPU once (config.c: iterserve_configure), and
every kernel reads that. Tests and benchmarks change it the same way (`set_activations`,
`gemm_isa`, `int8_isa` are shorthands for `configure` with one field replaced).

An A/B against the kernels of another commit is a second worktree of it (`git worktree add`),
run side by side, not a switch in the product.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from iterserve.model.kernels import build
from iterserve.model.kernels._abi import Config
from iterserve.model.kernels.build import state_of

log = logging.getLogger("iterserve.model.kernels")

ACTIVATION_MODES = {"float": 0, "int8": 1, "auto": 2}     # iterserve.h ITERSERVE_ACT_*
# A layer's own mode may also be "split8" (the LM head under auto: dispatch.c, qdot8.c's
# iterserve_k_split8): not a process mode, since prefill calls take the float path under it.
LAYER_ACTIVATION_MODES = {**ACTIVATION_MODES, "split8": 3}
ISAS = {None: 0, "avx2": 1, "avx512": 2}                  # iterserve.h ITERSERVE_ISA_*


@dataclass(frozen=True)
class KernelConfig:
    """How the native kernels compute.

    activations: "float" (every weight block expanded to float32: results equal a float
    GEMM over gguf-py's dequantised weights up to summation order; the numerical reference,
    and the library's state until configured), "int8" (activation rows quantised to 8 bits
    once per call and dotted in integers, as llama.cpp does, for the types `supports_int8`
    names) or "auto" (int8 and bf16 where dispatch.c measured them faster; the engine's
    default, `--kernel-activations`). A layer may run its calls under a mode of its own
    (ops.qgemm's `activations`): under auto the LM head runs split8 (layers.Linear).
    isa: the widest vector ISA the kernels may use: None (the best this CPU has), "avx2" or
    "avx512" (more than the CPU has falls back to the best). Threads follow torch's
    (`torch.get_num_threads()`, read per call).
    batch_invariant: every linear output computed in one order whatever the call's row count
    (dispatch.c): a sequence's logits do not depend on what else its step holds. Off by
    default: at decode row counts it costs 1.2-3x per GEMM call (measured, see dispatch.c).
    """

    activations: str = "float"
    isa: str | None = None
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATION_MODES:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATION_MODES)}, "
                             f"not {self.activations!r}")
        if self.isa not in ISAS:
            raise ValueError(f"isa must be None, avx2 or avx512, not {self.isa!r}")

    @classmethod
    def from_knobs(cls, knobs: Any) -> "KernelConfig":
        """From the engine's knobs (core/config.py's KernelConfig: `kernel_activations`)."""
        mode = knobs.kernel_activations
        return cls(activations=str(getattr(mode, "value", mode)),
                   batch_invariant=bool(getattr(knobs, "batch_invariant", False)))


_current = KernelConfig()


def apply(lib: ctypes.CDLL) -> None:
    """Hand the current configuration to a loaded library (build.py calls it on load)."""
    c = Config(ACTIVATION_MODES[_current.activations], ISAS[_current.isa],
               int(_current.batch_invariant))
    lib.iterserve_configure(ctypes.byref(c))


build.on_load.append(apply)


def configure(cfg: KernelConfig) -> KernelConfig:
    """Set the process's kernel configuration (before the model loads; tests may change it
    between calls). Without the native library every linear runs torch's float path, so an
    int8 / auto choice only takes effect where the library loads. Returns `cfg`."""
    global _current
    if not isinstance(cfg, KernelConfig):
        raise TypeError(f"configure takes a KernelConfig, not {type(cfg).__name__}")
    _current = cfg
    lib = build._library()
    if lib is not None:
        apply(lib)
    elif cfg.activations == "int8":
        log.warning("kernel activations int8: native kernels unavailable (%s); float",
                    build.unavailable)
    return cfg


def config() -> KernelConfig:
    """The configuration in effect."""
    return _current


def _state() -> dict[str, int]:
    return state_of(build._lib())


def set_activations(mode: str) -> str:
    """`configure` with the activation mode replaced ("float", "int8" or "auto"); returns the
    mode now in use."""
    configure(dataclasses.replace(_current, activations=mode))
    return activations()


def set_batch_invariant(on: bool) -> bool:
    """`configure` with batch_invariant replaced; returns it."""
    configure(dataclasses.replace(_current, batch_invariant=bool(on)))
    return _current.batch_invariant


def activations() -> str:
    """The activation mode in use ("float" without the library)."""
    if build._library() is None:
        return "float"
    return _current.activations


def gemm_isa(want: str | None = None) -> str:
    """`configure` with the ISA cap replaced ("avx2", "avx512"; None: the best), then the ISA
    of the float kernels ("avx2" / "avx512"). Tests use it to run the AVX2 kernels on an
    AVX-512 CPU."""
    configure(dataclasses.replace(_current, isa=want))
    return "avx512" if _state()["wide"] == 2 else "avx2"


def int8_isa(want: str | None = None) -> str:
    """The same for the int8 kernels: want "avx2", "avx512vnni" or None; returns the ISA of
    the int8 kernels now ("avx2" / "avx512vnni")."""
    configure(dataclasses.replace(_current, isa={"avx512vnni": "avx512"}.get(want, want)))
    return "avx512vnni" if _state()["int8"] == 2 else "avx2"


def bf16_isa(want: str | None = None) -> str:
    """Whether the bf16 dot-product kernels may run: "none" caps the ISA at AVX2 (so they do
    not), None / "avx512bf16" lifts the cap; returns "avx512bf16" where they are in use."""
    if want is not None or _current.isa == "avx2":
        configure(dataclasses.replace(_current, isa="avx2" if want == "none" else None))
    return "avx512bf16" if _state()["bf16"] else "none"
