"""Same-process A/B of the KV pool's dtype on decode steps: float32 vs float16 pools, both on
the fused native decode path (kernels/decode_layers.c + decode_attention.c).

Why: at the SmolLM2-1.7B shape (32 KV heads of 64, 24 layers) a token's K/V take 384 KB in
float32, so 8 sequences at ~300 tokens read ~0.9 GB of K/V per step, as much as the Q4_K_M
weights. Decode steps are built by hand (lab/calibrate.py's grid points: D sequences at KV
length L, zeroed K/V, the work of a real decode), the two runners alternate round by round,
and medians are reported.

    python benchmarks/bench_kv_dtype.py MODEL ROUNDS DxL [DxL ...]
    python benchmarks/bench_kv_dtype.py ~/.cache/iterserve-models/smollm2-1.7b/smollm2-1.7b.Q4_K_M.gguf 7 8x384 1x384
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main(argv: list[str] | None = None) -> int:
    from iterserve.core.fit import GridPoint
    from iterserve.lab.calibrate import _build_outputs
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    path, rounds = argv[0], int(argv[1])
    points = [GridPoint(int(a), int(b)) for a, b in (x.split("x") for x in argv[2:])]
    runners = {}
    for kv in ("float32", "float16"):
        loaded = load_model(path, kv_cache_dtype=kv)
        outs, nb = _build_outputs(points, 16, loaded.config.vocab_size)
        r = ModelRunner(loaded, num_blocks=nb, block_size=16)
        assert r.fused_decode, f"{kv}: the fused decode path is not in use"
        for o in outs:                         # warm-up
            r.execute(o)
        runners[kv] = (r, outs)
    times = {(kv, i): [] for kv in runners for i in range(len(points))}
    for rd in range(rounds):
        for kv in (("float32", "float16") if rd % 2 == 0 else ("float16", "float32")):
            r, outs = runners[kv]
            for i, o in enumerate(outs):
                t = time.perf_counter()
                r.execute(o)
                times[(kv, i)].append(time.perf_counter() - t)
    res = {}
    for i, p in enumerate(points):
        a = statistics.median(times[("float32", i)])
        b = statistics.median(times[("float16", i)])
        res[p.label()] = {"f32_ms": round(a * 1e3, 1), "f16_ms": round(b * 1e3, 1),
                          "f32_over_f16": round(a / b, 3)}
    print(json.dumps({"model": path, "rounds": rounds, "load": os.getloadavg(),
                      "points": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
