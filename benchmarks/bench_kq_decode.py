"""The K-quant int8 kernels (model/kernels/qdot8.c's decode kernels, prefill8.c's GEMM) on
real shapes, same process, alternating.

For each type, SmolLM2-1.7B shape (qo 2048x2048, gate_up 8192x2048, down 2048x8192, lm_head
49152x2048) or Llama-3.1-8B shape (qo8 4096x4096, gate_up8 28672x4096, down8 4096x14336),
thread count and row count, the decode kernels (`kernels.qgemm_int8`) and the int8 GEMM
(`kernels.gemm_int8`) run in turn, `--repeats` times, each timing at least `--min-s`;
medians; `decode_over_gemm8` < 1 means the decode kernels are faster (what dispatch.c's
hand-over rows are measured from). `--cold MB` cycles weight copies of at least MB megabytes
so each call streams from memory (more than the 32 MB L3: 96). `--clock cpu` times this
process's CPU time (one thread on a loaded machine: time lost to other processes does not
count; with two threads it sums both).

    PYTHONPATH=src python benchmarks/bench_kq_decode.py --cold 96 --clock cpu --threads 1
    PYTHONPATH=src python benchmarks/bench_kq_decode.py --decode MODEL.gguf --batch 8 \\
        --steps 16 --repeats 3 --threads 2 --out benchmarks/results/kq-decode-e2e-b8.json

`--decode` instead times end-to-end greedy generation (the offline LLM, auto activations).
Writes JSON (`--out`, default benchmarks/results/kq-decode.json).

An A/B against the kernels of another commit: check that commit out in a second worktree
(`git worktree add ../ab <commit>`), run this script in both trees alternately (same
machine, same arguments, interleaved runs) and compare the JSON files; the product keeps no
switch for superseded kernels.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from iterserve.model import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import time_call  # noqa: E402  (benchmarks/: the shared timing loop)
from bench_int8 import random_blocks  # noqa: E402  (valid random blocks, tests/fixtures)

SHAPES = {"qo": (2048, 2048), "gate_up": (8192, 2048), "down": (2048, 8192),
          "lm_head": (49152, 2048), "qo8": (4096, 4096), "gate_up8": (28672, 4096),
          "down8": (4096, 14336)}


def ab(types, shapes, threads, rows, repeats, min_s, cold_mb, clock, sides) -> list[dict]:
    out = []
    for name in types:
        for shape in shapes:
            n, k = SHAPES[shape]
            t, w = random_blocks(name, n, k)
            ws = [w] + [w.clone() for _ in range(max(0, -(-(cold_mb << 20) // w.numel()) - 1))]
            for th in threads:
                torch.set_num_threads(th)
                for m in rows:
                    x = torch.randn(m, k)
                    y = torch.empty(m, n)
                    it = iter(range(1 << 62))
                    fn = lambda: kernels.qgemm_int8(t, ws[next(it) % len(ws)], k, x, y)  # noqa: E731
                    fns = {"decode": fn, "gemm8": lambda: kernels.gemm_int8(  # noqa: E731
                        t, ws[next(it) % len(ws)], k, x, y)}
                    times = {s: [] for s in sides}
                    for _ in range(repeats):
                        for s in sides:
                            times[s].append(time_call(fns[s], min_s, clock))
                    med = {s: statistics.median(v) for s, v in times.items()}
                    base = sides[0]
                    row = {"type": name, "shape": shape, "n": n, "k": k, "threads": th, "rows": m,
                           **{f"{s}_us": round(med[s] * 1e6, 1) for s in med},
                           **{f"{s}_gbs": round(w.numel() / med[s] / 1e9, 2) for s in med},
                           **{f"{base}_over_{s}": round(med[base] / med[s], 3)
                              for s in med if s != base}}
                    print(json.dumps(row), flush=True)
                    out.append(row)
    return out


def decode_ab(model: str, batch: int, steps: int, repeats: int, threads: int) -> dict:
    """End to end: greedy generation of `batch` sequences, `steps` tokens each, through the
    offline LLM (auto activations), after one warm-up round: median output tokens/s
    (prefill of the short prompts included)."""
    from iterserve import LLM, SamplingParams
    torch.set_num_threads(threads)
    llm = LLM(model=model, max_num_seqs=max(batch, 1), kv_cache_memory=0.25)
    sp = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    prompts = [f"Once upon a time {i}" for i in range(batch)]
    res = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t0
        if rep:
            res.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    return {"model": model, "batch": batch, "steps": steps, "threads": threads,
            "tok_s": round(statistics.median(res), 3), "raw": res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K")
    ap.add_argument("--shapes", default="qo,gate_up,down")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--rows", default="1,2,4,6,8,12")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--min-s", type=float, default=0.05, help="seconds per timing")
    ap.add_argument("--cold", type=int, default=96, metavar="MB")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--isa", choices=["avx2", "avx512vnni"], default=None)
    ap.add_argument("--decode", metavar="GGUF", help="end-to-end generation on this model instead")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results/kq-decode.json")
    a = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"native kernels unavailable: {kernels.unavailable}")
    if a.isa:
        kernels.int8_isa(a.isa)
    if a.decode:
        res = decode_ab(a.decode, a.batch, a.steps, a.repeats, int(a.threads.split(",")[-1]))
        print(json.dumps(res))
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"features": sorted(kernels.features()),
                                           "note": "under load",
                                           "decode": res}, indent=1) + "\n")
        print("wrote", a.out)
        return
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    sides = ["decode", "gemm8"]
    rows = ab(a.types.split(","), a.shapes.split(","), [int(v) for v in a.threads.split(",")],
              [int(v) for v in a.rows.split(",")], a.repeats, a.min_s, a.cold, clock, sides)
    meta = {"machine": platform.processor() or platform.machine(),
            "features": sorted(kernels.features()), "int8_isa": kernels.int8_isa(),
            "clock": a.clock, "cold_mb": a.cold, "repeats": a.repeats,
            "note": "same process, sides alternating, medians; machine shared (under load)"}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({**meta, "results": rows}, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
