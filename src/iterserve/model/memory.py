"""The memory plan: what a loaded model and its KV cache will hold, checked before allocating.

Why: a process that asks for more than the machine has is killed by the kernel's OOM killer
mid-load, with no word about why. `ModelRunner` builds this plan before it allocates the KV
pools, logs it, and raises `InsufficientMemoryError` (a ModelLoadError, so the CLIs print it
and exit 1) when it cannot fit. The same dict is `ModelRunner.memory_plan`, for
`/v1/models` / `/v1/engine/stats` to report. Its shape (all sizes in bytes):

    {"weights": {"file_bytes", "bytes", "mapped_bytes", "anonymous_bytes",
                 "bytes_by_encoding": {"Q4_K": n, "Q6_K": n, "F32": n, ...}},
     "linears": {"native": n, "mixed": n, "reference": n, "dense": n,
                 "by_encoding": {"Q4_K": {"native": n, "reference": n}, ...}},
     "fused_decode": bool,
     "kv_cache": {"dtype", "num_blocks", "block_size", "bytes", "swap_bytes",
                  "ram_tier_blocks", "ram_tier_bytes"},
     "process_rss_bytes", "reserve_bytes", "planned_peak_bytes", "available_bytes",
     "fits": bool}

`mapped_bytes` are weights read from the file's mapping as they are used (they become
resident, shared with the page cache); `anonymous_bytes` are weights copied at load (fused
q/k/v and gate/up, gathered rows, dense conversions), already resident when the plan is made.
The check: mapped weights + KV + swap + the RAM tier + reserve must fit in what the system
(and the cgroup, in a container) still has available. The engine adds a "kv_tiers" entry
(the disk tier's directory and bound) once the tiers are wired.
"""

from __future__ import annotations

import logging
import os

import torch

from iterserve.errors import InsufficientMemoryError
from iterserve.model.kv_cache import PagedKVCache
from iterserve.model.layers import Embedding, Linear
from iterserve.model.weights import type_name

log = logging.getLogger(__name__)

# Activations, logits, the reference path's tiles, allocator slack: what a step needs beyond
# weights and KV (a 256-token step of an 8B-shaped model needs ~100 MB).
RESERVE_BYTES = 256 << 20


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_available() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), if it is limited."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return None
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return int(limit) - int(f.read().strip())
    except (OSError, ValueError, StopIteration):
        return None


def available_bytes() -> int | None:
    values = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    return min(values) if values else None


def process_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _weight_tensors(model: torch.nn.Module):
    """(encoding name, uint8-or-float tensor) of every distinct weight of the model."""
    seen: set[tuple[int, int]] = set()

    def once(t: torch.Tensor) -> bool:
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key in seen:
            return False
        seen.add(key)
        return True

    for m in model.modules():
        if isinstance(m, (Linear, Embedding)) and m.encoded is not None:
            for t, w in m.encoded.segments:
                if once(w):
                    yield type_name(t), w
    for p in model.parameters():
        if once(p):
            yield {torch.float32: "F32", torch.float16: "F16",
                   torch.bfloat16: "BF16"}.get(p.dtype, str(p.dtype)), p


def _mapped_ranges(loaded) -> list[tuple[int, int]]:
    ranges: dict[str, tuple[int, int]] = {}
    for r in getattr(loaded, "refs", {}).values():
        if r.mapping.numel():
            lo, hi = r.mapping.data_ptr(), r.mapping.data_ptr() + r.nbytes
            a, b = ranges.get(r.path, (lo, hi))
            ranges[r.path] = (min(a, lo), max(b, hi))
    return list(ranges.values())


def compute_paths(model: torch.nn.Module) -> dict:
    """How the Linears compute: {"linears": {native, mixed, reference, dense, by_encoding}}."""
    counts = {"native": 0, "mixed": 0, "reference": 0, "dense": 0}
    by: dict[str, dict[str, int]] = {}
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        counts[m.compute_path()] += 1
        if m.encoded is not None:
            for t in m.encoded.types:
                d = by.setdefault(type_name(t), {"native": 0, "reference": 0})
                d["native" if t in m._native else "reference"] += 1
    return {"linears": {**counts, "by_encoding": by}}


def plan_memory(loaded, *, num_blocks: int, block_size: int, num_swap_blocks: int = 0,
                kv_dtype: torch.dtype | None = None, num_tier_blocks: int = 0,
                kv_bytes: int | None = None) -> dict:
    """The plan dict (module docstring) for `loaded` with a KV pool of this size
    (`kv_bytes`: the pools' bytes when some layers' pools are smaller, sliding windows)."""
    cfg = loaded.config
    kv_dtype = kv_dtype or cfg.kv_cache_dtype or cfg.dtype
    per_block = PagedKVCache.bytes_per_block(cfg, block_size, kv_dtype)
    by_enc: dict[str, int] = {}
    mapped = anon = 0
    ranges = _mapped_ranges(loaded)
    on_cpu = True
    for enc, t in _weight_tensors(loaded.model):
        n = t.numel() * t.element_size()
        by_enc[enc] = by_enc.get(enc, 0) + n
        on_cpu = on_cpu and t.device.type == "cpu"
        p = t.data_ptr()
        if t.device.type == "cpu" and any(a <= p < b for a, b in ranges):
            mapped += n
        elif t.device.type == "cpu":
            anon += n
    kv_bytes = num_blocks * per_block if kv_bytes is None else kv_bytes
    swap_bytes = num_swap_blocks * per_block
    tier_bytes = num_tier_blocks * per_block
    rss = process_rss_bytes()
    device_kv = kv_bytes if next(loaded.model.parameters()).device.type == "cpu" else 0
    need = mapped + device_kv + swap_bytes + tier_bytes + RESERVE_BYTES
    avail = available_bytes()
    return {
        "weights": {"file_bytes": int(getattr(loaded, "file_bytes", 0) or 0),
                    "bytes": mapped + anon + (0 if on_cpu else sum(by_enc.values())),
                    "mapped_bytes": mapped, "anonymous_bytes": anon,
                    "bytes_by_encoding": dict(sorted(by_enc.items(), key=lambda kv: -kv[1]))},
        "kv_cache": {"dtype": str(kv_dtype).removeprefix("torch."), "num_blocks": num_blocks,
                     "block_size": block_size, "bytes": kv_bytes, "swap_bytes": swap_bytes,
                     "ram_tier_blocks": num_tier_blocks, "ram_tier_bytes": tier_bytes},
        "process_rss_bytes": rss,
        "reserve_bytes": RESERVE_BYTES,
        "planned_peak_bytes": rss + need,
        "available_bytes": None if avail is None else avail + rss,
        "fits": avail is None or need <= avail,
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 30):.2f} GiB"


def check_memory_plan(plan: dict) -> None:
    """Raise InsufficientMemoryError with a clear message when the plan does not fit."""
    if plan["fits"]:
        return
    kv, w = plan["kv_cache"], plan["weights"]
    spare = plan["available_bytes"] - plan["process_rss_bytes"] - w["mapped_bytes"] \
        - kv["swap_bytes"] - kv.get("ram_tier_bytes", 0) - plan["reserve_bytes"]
    raise InsufficientMemoryError(
        f"not enough memory: the model's weights ({_gib(w['bytes'])}) plus the requested KV "
        f"cache ({_gib(kv['bytes'])}, {kv['num_blocks']} blocks of {kv['block_size']} tokens in "
        f"{kv['dtype']}), swap space ({_gib(kv['swap_bytes'])}) and the RAM tier "
        f"({_gib(kv.get('ram_tier_bytes', 0))}) need about "
        f"{_gib(plan['planned_peak_bytes'])}, but only {_gib(plan['available_bytes'])} are "
        f"available to this process. Ask for a smaller KV cache (--kv-cache-memory / "
        f"--num-kv-blocks; about {_gib(max(spare, 0))} would fit), --kv-cache-dtype float16, "
        f"or a more compact quantisation of the model.")


def log_memory_plan(plan: dict) -> None:
    w, kv, lin = plan["weights"], plan["kv_cache"], plan.get("linears", {})
    enc = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in w["bytes_by_encoding"].items())
    log.info("weights: %.1f MB (file %.1f MB; %.1f MB mapped, %.1f MB copied at load) by "
             "encoding: %s", w["bytes"] / 1e6, w["file_bytes"] / 1e6, w["mapped_bytes"] / 1e6,
             w["anonymous_bytes"] / 1e6, enc)
    if lin:
        ref = {k: v["reference"] for k, v in lin.get("by_encoding", {}).items() if v["reference"]}
        log.info("linears: %d on the native kernel, %d mixed, %d on the reference path%s, "
                 "%d dense; fused decode layers %s", lin["native"], lin["mixed"],
                 lin["reference"], f" (segments by type: {ref})" if ref else "", lin["dense"],
                 "on" if plan.get("fused_decode") else "off")
    log.info("KV cache: %s in %s (%d blocks of %d tokens), swap %s, RAM tier %s; planned "
             "peak %s of %s available", _gib(kv["bytes"]), kv["dtype"], kv["num_blocks"],
             kv["block_size"], _gib(kv["swap_bytes"]), _gib(kv.get("ram_tier_bytes", 0)),
             _gib(plan["planned_peak_bytes"]), _gib(plan["available_bytes"]))
