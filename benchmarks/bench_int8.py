"""Float vs int8 activations in the decode GEMM (kernels/qdot8.c), same process, alternating.

For each weight type and SmolLM2-1.7B shape (q/o 2048x2048, gate/up 8192x2048, down 2048x8192,
LM head 49152x2048), thread count and row count, times `kernels.qgemm` in float mode (what
iterserve_qgemm runs without int8: qgemm.c's register kernels, or the panel GEMM from its
per-type row count on) against `kernels.qgemm_int8`, alternating the two `--repeats` times
and keeping each side's median; the ratio float/int8 > 1 means int8 is faster. Weights are
random valid blocks (random codes under small f16 scales), so any type and shape is quick to
make. Writes JSON (`--out`, default benchmarks/results/int8-qgemm.json).

    PYTHONPATH=src python benchmarks/bench_int8.py --quick      # ~1 min
    PYTHONPATH=src python benchmarks/bench_int8.py              # the full grid, ~5-8 min

`--decode MODEL.gguf` instead times end-to-end greedy generation (`--batch` sequences,
`--steps` tokens each, prefill of a short prompt included) of a model file through the
offline LLM, float and auto (the default: int8 where measured faster) alternating:

    PYTHONPATH=src python benchmarks/bench_int8.py --decode ~/.cache/iterserve-models/\
        smollm2-1.7b/smollm2-1.7b.Q4_K_M.gguf --batch 1 --steps 32 --repeats 3 --threads 2

`--split8` times the LM head's split activations (kernels.qgemm_split8) against float and
int8 on head shapes (`--shapes lm_head,head135`): where split8 wins, dispatch.c routes it.

`--crossover` (same process, alternating, `--clock cpu --cold 96`) times the int8 decode
kernels (qdot8.c), the int8 prefill GEMM (prefill8.c) and `auto` (the engine's dispatch,
dispatch.c's table) at decode row counts: where auto hands over; `--sides decode,gemm8`
picks sides (the first is the ratios' baseline); `--isa avx2` also forces the float kernels
to AVX2 (an AVX2-only CPU):

    PYTHONPATH=src python benchmarks/bench_int8.py --crossover --sides decode,gemm8,auto \
        --types Q4_0,Q4_1,Q5_0,Q5_1,Q8_0 --shapes qo,gate_up,down --threads 1,2 \
        --rows 4,8,12,14,16,24,32 --clock cpu --cold 96      # ~6 min quiet

An A/B against the kernels of another commit runs this script in a second worktree of that
commit (`git worktree add ../ab <commit>`), alternating runs of the two trees with the same
arguments, and compares their JSON: the product keeps no switch for superseded kernels.

Every mode is one loop (`ab_grid`: the sides of a `*_sides` function alternated, medians,
benchmarks/_timing.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from iterserve.model import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import alternate  # noqa: E402

SHAPES = {"qo": (2048, 2048), "gate_up": (8192, 2048), "down": (2048, 8192),
          "lm_head": (49152, 2048),
          # the bundled 135M model (hidden 576): its tied Q8_0 LM head, q/o, gate|up, down
          "head135": (49152, 576), "qo135": (576, 576), "up135": (1536, 576), "down135": (576, 1536)}
def random_blocks(name: str, n: int, k: int, seed: int = 0) -> tuple[int, torch.Tensor]:
    """(type id, uint8 [n, row_bytes]): random codes under small valid f16 scales, from the
    test fixtures (tests/fixtures/tiny_gguf.random_blocks), so any type and shape is quick."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fixtures.tiny_gguf import random_blocks as blocks
    from gguf import GGMLQuantizationType
    raw = blocks(name, n, k, np.random.default_rng(seed))
    return int(GGMLQuantizationType[name]), torch.from_numpy(raw)


CLOCK = time.perf_counter
COPY_BYTES = 0          # --cold MB: weight copies cycled per call, at least this many bytes
Q32 = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")     # the 32-element types


def ab_grid(types, shapes, threads, rows, repeats: int, min_s: float, make_sides) -> list[dict]:
    """The one A/B loop of this file: for each type, shape, thread count and row count,
    `make_sides(name, t, next_w, k, x, y)` gives ({side: callable}, {side: prepare}); the
    sides are timed in turn `repeats` times (_timing.alternate, CLOCK) and each row reports
    their medians (`<side>_us`), weight GB/s per call (`<side>_gbs`) and `<first>_over_<side>`
    (> 1: that side is faster than the first). Weights: distinct copies of at least --cold MB
    cycled per call, so with --cold they come from memory, not the L3."""
    out = []
    for name in types:
        for shape in shapes:
            n, k = SHAPES[shape]
            t, w = random_blocks(name, n, k)
            ws = [w] + [w.clone() for _ in range(max(0, -(-COPY_BYTES // w.numel()) - 1))]
            it = iter(range(1 << 62))
            next_w = lambda: ws[next(it) % len(ws)]          # noqa: E731
            for th in threads:
                torch.set_num_threads(th)
                for m in rows:
                    x = torch.randn(m, k)
                    y = torch.empty(m, n)
                    sides, prepare = make_sides(name, t, next_w, k, x, y)
                    med = alternate(sides, repeats, min_s, CLOCK, prepare)
                    base = next(iter(sides))
                    row = {"type": name, "shape": shape, "n": n, "k": k, "threads": th, "rows": m,
                           **{f"{s}_us": round(v * 1e6, 1) for s, v in med.items()},
                           **{f"{s}_gbs": round(w.numel() / v / 1e9, 2) for s, v in med.items()},
                           **{f"{base}_over_{s}": round(med[base] / v, 3)
                              for s, v in med.items() if s != base}}
                    print(json.dumps(row), flush=True)
                    out.append(row)
    return out


def float_int8_sides(name, t, next_w, k, x, y):
    """float (kernels.qgemm in float mode: qgemm.c's register kernels, or the panel GEMM from
    its per-type row count on) against int8 (kernels.qgemm_int8, qdot8.c's kernels)."""
    return ({"float": lambda: kernels.qgemm(t, next_w(), k, x, y),
             "int8": lambda: kernels.qgemm_int8(t, next_w(), k, x, y)},
            {"float": lambda: kernels.set_activations("float")})


def crossover_sides(name, t, next_w, k, x, y):
    """The decode kernels (qdot8.c, `qgemm_int8`) against the int8 prefill GEMM (prefill8.c,
    `gemm_int8`) at decode row counts, and `auto` (kernels.qgemm in the auto mode: what the
    engine runs, hand-over included). decode_over_gemm8 > 1: the prefill GEMM is faster than
    the decode kernels."""
    sides = {"decode": lambda: kernels.qgemm_int8(t, next_w(), k, x, y),
             "gemm8": lambda: kernels.gemm_int8(t, next_w(), k, x, y),
             "auto": lambda: kernels.qgemm(t, next_w(), k, x, y)}
    prepare = {"auto": lambda: kernels.set_activations("auto"),
               "decode": lambda: kernels.set_activations("float"),
               "gemm8": lambda: kernels.set_activations("float")}
    return sides, prepare


def split8_sides(name, t, next_w, k, x, y):
    """The LM head's kernels: float (kernels.qgemm in float mode), split8 (kernels.qgemm_split8:
    each row as two int8 rows) and int8 (kernels.qgemm_int8); float_over_split8 > 1: split
    activations are faster. Where they are, dispatch.c routes the head's split mode to them
    (split8_takes)."""
    return ({"float": lambda: kernels.qgemm(t, next_w(), k, x, y),
             "split8": lambda: kernels.qgemm_split8(t, next_w(), k, x, y),
             "int8": lambda: kernels.qgemm_int8(t, next_w(), k, x, y)},
            {"float": lambda: kernels.set_activations("float")})


def only_sides(make_sides, names):
    """make_sides restricted to `names` (in that order; names the type lacks are left out)."""
    def make(*args):
        sides, prepare = make_sides(*args)
        return ({n: sides[n] for n in names if n in sides},
                {n: prepare[n] for n in names if n in prepare})
    return make


def decode_ab(model: str, batch: int, steps: int, repeats: int, threads: int) -> dict:
    """Greedy generation of `batch` sequences through the offline LLM, float and auto modes
    alternating `repeats` times (after one warm-up round), `steps` tokens each: median output
    tokens/s per mode (random-weight models: greedy tokens need not agree)."""
    from iterserve import LLM, SamplingParams
    torch.set_num_threads(threads)
    llm = LLM(model=model, max_num_seqs=max(batch, 1), kv_cache_memory=0.25)
    sp = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    prompts = [f"Once upon a time {i}" for i in range(batch)]
    modes = ("float", "auto")
    res = {m: [] for m in modes}
    texts = {}
    for rep in range(repeats + 1):
        for mode in modes:
            kernels.set_activations(mode)
            t0 = CLOCK()
            outs = llm.generate(prompts, sp)
            dt = CLOCK() - t0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            if rep:                                    # the first round warms up
                res[mode].append(toks / dt)
            texts[mode] = [list(o.outputs[0].token_ids) for o in outs]
    a_, b_ = modes
    agree = sum(a == b for x, y in zip(texts[a_], texts[b_]) for a, b in zip(x, y))
    total = sum(len(x) for x in texts[a_])
    return {"model": model, "batch": batch, "steps": steps, "threads": threads,
            f"{a_}_tok_s": round(statistics.median(res[a_]), 3),
            f"{b_}_tok_s": round(statistics.median(res[b_]), 3),
            f"{b_}_over_{a_}": round(statistics.median(res[b_]) / statistics.median(res[a_]), 3),
            "greedy_tokens_equal": f"{agree}/{total}", "raw": res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q4_0,Q8_0")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-s", type=float, default=0.05, help="seconds per timing")
    ap.add_argument("--quick", action="store_true", help="Q4_K and Q4_0, 2048x2048 + down, 3 repeats")
    ap.add_argument("--decode", metavar="GGUF", help="end-to-end decode A/B on this model instead")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--isa", choices=["avx2", "avx512vnni"], default=None,
                    help="force the int8 kernels' instruction set (default: the best here)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (one thread on a loaded machine: "
                         "time lost to other processes does not count)")
    ap.add_argument("--crossover", action="store_true",
                    help="the decode kernels against the int8 prefill GEMM (prefill8.c) at "
                         "decode row counts (where auto hands the K-quants over)")
    ap.add_argument("--split8", action="store_true",
                    help="the LM head's split activations against float and int8 (use "
                         "--shapes lm_head,head135)")
    ap.add_argument("--sides", default=None, metavar="S,S,...",
                    help="with --crossover (decode, gemm8, auto) or --split8 (float, split8, "
                         "int8): only these sides; the first is the baseline of the ratios")
    ap.add_argument("--cold", type=int, default=0, metavar="MB",
                    help="cycle distinct weight copies of at least MB megabytes in "
                         "all (more than the L3), so each call streams its weights from memory")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"native kernels unavailable: {kernels.unavailable}")
    global CLOCK, COPY_BYTES
    COPY_BYTES = a.cold << 20
    if a.clock == "cpu":
        CLOCK = time.process_time
    if a.isa:
        kernels.int8_isa(a.isa)
        if a.isa == "avx2":     # an AVX2-only CPU: the float kernels too
            kernels.gemm_isa("avx2")
    meta = {"machine": platform.processor() or platform.machine(), "features":
            sorted(kernels.features()), "int8_isa": kernels.int8_isa(), "note":
            "same process, the sides alternating (float / int8, or the sides named), "
            "medians; machine possibly loaded",
            "clock": a.clock}
    if a.decode:
        result = {**meta, "decode": decode_ab(a.decode, a.batch, a.steps, a.repeats,
                                              int(a.threads.split(",")[-1]))}
        print(json.dumps(result["decode"]))
        out = a.out or f"benchmarks/results/int8-decode-b{a.batch}.json"
    else:
        if a.quick:
            a.types, a.shapes, a.repeats = "Q4_K,Q4_0", "qo,down", 3
        sides = crossover_sides if a.crossover else split8_sides if a.split8 else float_int8_sides
        if (a.crossover or a.split8) and a.sides:
            sides = only_sides(sides, a.sides.split(","))
        rows = ab_grid(a.types.split(","), a.shapes.split(","),
                       [int(v) for v in a.threads.split(",")], [int(v) for v in a.rows.split(",")],
                       a.repeats, a.min_s, sides)
        kernels.set_activations("float")
        result = {**meta, "results": rows}
        out = a.out or ("benchmarks/results/kq-crossover.json" if a.crossover
                        else "benchmarks/results/split8-head.json" if a.split8
                        else "benchmarks/results/int8-qgemm.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
