"""Same-process A/B of the decode GEMM kernels on real weight shapes (not in CI).

1. `layout`: a split layout (model/quant.py: quants in one array, f16 scales widened to
   float32 in others; kernels/qgemm_split.c) against the GGUF-native layout (blocks as in the
   file, f16 scales converted per block with F16C; kernels/qgemm.c), on the bundled model's
   fused q/k/v, o, gate/up and down of every layer. Calls alternate A, B, A, B ... so load on
   the machine hits both alike; the median of each is reported.
2. `types`: the native qgemm of each type against the torch reference (dequantise the weight
   with kernels.dequant, then F.linear) on a 1.7B-shaped weight (random blocks).
3. `prefill`: the prefill GEMM over encoded weights (kernels.gemm, kernels/prefill.c)
   against (a) the reference path it replaced (4 MB float32 tiles decoded per call, then
   oneDNN: layers.Linear._reference) and (b) oneDNN over a prepacked float32 copy (a
   float prefill), at M = 64..512 rows, on the bundled model's shapes (fused q/k/v 960x576,
   o 576x576, gate/up 3072x576 as one 1536x576 pair, down 576x1536, LM head
   49152x576) and 1.7B shapes (2048x2048, 8192x2048); same process, alternating, medians.
   With --threads 1 the time is the thread's CPU time (time.thread_time), which a loaded
   machine disturbs far less than wall time.

4. `paths`: per type, qgemm's register kernel in AVX2 and AVX-512, the generic kernel and the
   panel GEMM at decode row counts, on 1.7B and bundled-model shapes (`paths` above).
5. `ab`: this tree's qgemm (or, with --function gemm, the prefill GEMM, also against oneDNN
   over a prepacked float32 copy) against the same function of another git revision
   (--baseline-rev, built into a temporary .so and loaded next to this tree's), same process,
   alternating.

    PYTHONPATH=src python benchmarks/bench_qgemm.py [layout|types|prefill|paths|ab] [--rows 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def layout(rows_list: list[int], rounds: int) -> dict:
    from gguf import GGUFReader
    from iterserve.model import kernels
    from iterserve.model.default_model import default_model_path
    from iterserve.model.quant import BlockQuantWeight

    reader = GGUFReader(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    split_fn = kernels.qgemm()
    layers = []
    i = 0
    while f"blk.{i}.attn_q.weight" in tensors:
        group = {"qkv": ["attn_q", "attn_k", "attn_v"], "o": ["attn_output"],
                 "gate_up": ["ffn_gate", "ffn_up"], "down": ["ffn_down"]}
        for name, parts in group.items():
            ts = [tensors[f"blk.{i}.{p}.weight"] for p in parts]
            kind = ts[0].tensor_type.name
            raw = np.concatenate([np.asarray(t.data).reshape(int(t.shape[1]), -1) for t in ts])
            n, k = raw.shape[0], int(ts[0].shape[0])
            bq = BlockQuantWeight.from_gguf(kind, raw, (n, k))
            layers.append((name, int(ts[0].tensor_type), torch.from_numpy(raw.copy()), bq, n, k))
        i += 1
    threads = torch.get_num_threads()
    result = {"model": str(default_model_path()), "layers": i, "threads": threads,
              "kinds": sorted({bq.kind for _, _, _, bq, _, _ in layers}), "rows": {}}
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in {L[5] for L in layers}}
        outs = {n: torch.empty(rows, n) for n in {L[4] for L in layers}}

        def old():
            for _, _, _, bq, n, k in layers:
                bq.matmul(xs[k], split_fn, threads)

        def new():
            for _, t, raw, _, n, k in layers:
                kernels.qgemm(t, raw, k, xs[k], outs[n])
        # the kernels alone (pointers prepared once), as the fused decode call runs them
        lib = kernels._library()
        raw_old = [(bq, n, k, (1 if bq.kind == "Q4_1" else 2 if bq.kind == "Q8_0" else 0),
                    xs[k].data_ptr(), bq.qs.data_ptr(), bq.d.data_ptr(),
                    0 if bq.m is None else bq.m.data_ptr(), outs[n].data_ptr())
                   for _, _, _, bq, n, k in layers]
        raw_new = [(t, raw.data_ptr(), n, raw.shape[1], k, xs[k].data_ptr(), outs[n].data_ptr())
                   for _, t, raw, _, n, k in layers]

        def old_c():
            for _, n, k, kind, xp, qs, d, m, op in raw_old:
                lib.iterserve_qgemm_split(kind, xp, rows, k, qs, d, m, op, n, threads)

        def new_c():
            for t, wp, n, rb, k, xp, op in raw_new:
                lib.iterserve_qgemm(t, wp, n, rb, k, xp, rows, k, op, n, threads)
        res = {}
        for label, (fa, fb) in {"python": (old, new), "kernel": (old_c, new_c)}.items():
            fa(), fb()
            a, b = [], []
            for _ in range(rounds):
                a.append(_median_us(fa, 3))
                b.append(_median_us(fb, 3))
            ma, mb = statistics.median(a), statistics.median(b)
            res[label] = {"split_layout_us_per_step": round(ma),
                          "gguf_layout_us_per_step": round(mb), "gguf_over_split": round(mb / ma, 3)}
            print(f"rows {rows:3d} {label:7s}: split {ma / 1e3:7.2f} ms  gguf {mb / 1e3:7.2f} ms  "
                  f"(gguf/split {mb / ma:.3f}) per step of {len(layers)} GEMMs")
        result["rows"][rows] = res
    return result


def types(rows_list: list[int], rounds: int) -> dict:
    import sys
    sys.path.insert(0, "tests")
    from fixtures.gguf_blocks import gguf_blocks
    from iterserve.model import kernels

    n, k = 2048, 2048
    result = {"shape": [n, k], "threads": torch.get_num_threads(), "types": {}}
    for name in ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K",
                 "IQ4_NL", "IQ4_XS", "MXFP4", "F16", "BF16"]:
        t, raw, _ = gguf_blocks(name, n, k)
        scratch = torch.empty(n, k)
        row = {}
        for rows in rows_list:
            x, out = torch.randn(rows, k), torch.empty(rows, n)

            def native():
                kernels.qgemm(t, raw, k, x, out)

            def reference():
                F.linear(x, kernels.dequant(t, raw, k, scratch))
            a = statistics.median(_median_us(native, 5) for _ in range(rounds))
            b = statistics.median(_median_us(reference, 3) for _ in range(max(2, rounds // 3)))
            gbs = raw.numel() / a / 1e3
            row[rows] = {"native_us": round(a), "dequant_linear_us": round(b),
                         "native_weight_GB_s": round(gbs, 2)}
            print(f"{name:7s} rows {rows:3d}: native {a:8.0f} us ({gbs:5.1f} GB/s of blocks)  "
                  f"dequant+linear {b:8.0f} us  ({b / a:.1f}x)")
        result["types"][name] = row
    return result


PREFILL_SHAPES = {"bundled": [(576, 576), (960, 576), (1536, 576), (576, 1536), (49152, 576)],
                  "1.7B": [(2048, 2048), (8192, 2048)]}


def prefill(rows_list: list[int], rounds: int, types_: list[str], big: list[str]) -> dict:
    import sys
    sys.path.insert(0, "tests")
    from fixtures.gguf_blocks import gguf_blocks
    from iterserve.model import kernels
    from iterserve.model.layers import _float_mm
    from iterserve.model.weights import decode_rows, scratch, tile_rows

    threads = torch.get_num_threads()
    clock = time.thread_time if threads == 1 else time.perf_counter

    def med_ms(fn, reps):
        ts = []
        for _ in range(reps):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
        return statistics.median(ts) * 1e3

    result = {"threads": threads, "clock": clock.__name__, "isa": kernels.gemm_isa(None),
              "cases": []}
    for group, shapes in PREFILL_SHAPES.items():
        for name in (types_ if group == "bundled" else big):
            for n, k in shapes:
                if k % 256 and name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"):
                    continue
                t, raw, w = gguf_blocks(name, n, k)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
                del w
                step = tile_rows(k)
                for m in rows_list:
                    x, out = torch.randn(m, k), torch.empty(m, n)

                    def new():
                        kernels.gemm(t, raw, k, x, out)

                    def tiles():
                        for r0 in range(0, n, step):
                            r1 = min(n, r0 + step)
                            out[:, r0:r1] = _float_mm(x, decode_rows(t, raw[r0:r1], k,
                                                                     scratch(r1 - r0, k)))

                    def prepacked():
                        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                    fns = {"gemm": new, "tiles": tiles, "prepacked_f32": prepacked}
                    reps = max(3, int(2e8 / (2 * m * n * k) + 1)) if n * k < 1e7 else 3
                    for f in fns.values():
                        f()
                    got = {key: [] for key in fns}
                    for _ in range(rounds):
                        for key, f in fns.items():
                            got[key].append(med_ms(f, reps))
                    ms = {key: statistics.median(v) for key, v in got.items()}
                    case = {"group": group, "type": name, "n": n, "k": k, "m": m,
                            **{f"{key}_ms": round(v, 4) for key, v in ms.items()},
                            "gemm_GFLOPs": round(2 * m * n * k / ms["gemm"] / 1e6, 1),
                            "prepacked_over_gemm": round(ms["prepacked_f32"] / ms["gemm"], 3),
                            "tiles_over_gemm": round(ms["tiles"] / ms["gemm"], 3)}
                    result["cases"].append(case)
                    print(f"{name:5s} {n:5d}x{k:<5d} M={m:3d}: gemm {ms['gemm']:8.3f} ms "
                          f"({case['gemm_GFLOPs']:5.0f} GF/s)  tiles {ms['tiles']:8.3f}  "
                          f"prepacked {ms['prepacked_f32']:8.3f}  speedup vs tiles "
                          f"{case['tiles_over_gemm']:.2f}x, vs prepacked "
                          f"{case['prepacked_over_gemm']:.2f}x", flush=True)
                del packed
    return result


KQ_SHAPES = {"1.7B": [(2048, 2048), (8192, 2048), (2048, 8192)],
             "bundled": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]}


def paths(rows_list: list[int], rounds: int, types_: list[str], shapes: list[str],
          variants: list[str]) -> dict:
    """Same-process alternating A/B of qgemm's paths per type (kernels.qgemm_path):
    `avx512` / `avx2` = the type's register kernel with that ISA at any row count, `generic` =
    the decode-into-L1 kernel, `panel` = the prefill GEMM, `auto` = what qgemm does now (with
    the best ISA). Shapes whose k is not a multiple of the type's block are skipped. CPU time
    of the thread with one thread, wall time with more."""
    import sys
    sys.path.insert(0, "tests")
    from fixtures.gguf_blocks import gguf_blocks
    from iterserve.model import kernels

    threads = torch.get_num_threads()
    clock = time.thread_time if threads == 1 else time.perf_counter
    best = kernels.gemm_isa(None)
    variants = [v for v in variants if v != "avx512" or best == "avx512"]

    def med_us(fn, reps):
        ts = []
        for _ in range(reps):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
        return statistics.median(ts) * 1e6

    result = {"threads": threads, "clock": clock.__name__, "best_isa": best,
              "variants": variants, "cases": []}
    for name in types_:
        for group in shapes:
            for n, k in KQ_SHAPES[group]:
                blk = 256 if name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS") else 32
                if k % blk:
                    continue
                t, raw, _ = gguf_blocks(name, n, k)
                for m in rows_list:
                    x, out = torch.randn(m, k), torch.empty(m, n)

                    def run(v):
                        if v in ("avx512", "avx2"):
                            kernels.gemm_isa(v)
                            return lambda: kernels.qgemm_path("registers", t, raw, k, x, out)
                        kernels.gemm_isa(best)
                        return lambda: kernels.qgemm_path(v, t, raw, k, x, out)
                    reps = max(3, min(50, int(2e4 / max(1.0, raw.numel() / 2e4 * m ** 0.5))))
                    got = {v: [] for v in variants}
                    for v in variants:
                        run(v)()
                    for _ in range(rounds):
                        for v in variants:
                            f = run(v)
                            got[v].append(med_us(f, reps))
                    kernels.gemm_isa(best)
                    us = {v: statistics.median(got[v]) for v in variants}
                    case = {"type": name, "group": group, "n": n, "k": k, "m": m,
                            **{f"{v}_us": round(us[v], 1) for v in variants},
                            "weight_MB": round(raw.numel() / 1e6, 2)}
                    ref = "avx2" if "avx2" in us else variants[0]
                    for v in variants:
                        if v != ref:
                            case[f"{ref}_over_{v}"] = round(us[ref] / us[v], 3)
                    result["cases"].append(case)
                    print(f"{name:5s} {n:5d}x{k:<5d} M={m:3d} " + "  ".join(
                        f"{v} {us[v]:8.0f}" for v in variants) + "  " + "  ".join(
                        f"{key} {val}" for key, val in case.items() if "_over_" in key),
                        flush=True)
    return result


def _baseline_lib(rev: str):
    """The kernels of git revision `rev` built into a temporary .so and loaded by ctypes (its
    own symbols and ISA state, next to this tree's library in the same process)."""
    import ctypes
    import os
    import subprocess
    import tempfile
    from iterserve.model import kernels
    d = tempfile.mkdtemp(prefix="qgemm-base-")
    folder = "src/iterserve/model/kernels"
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{folder}"], check=True,
                           capture_output=True, text=True).stdout.split()
    srcs = []
    for name in names:
        if name.endswith((".c", ".h")):
            with open(os.path.join(d, name), "wb") as f:
                f.write(subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], check=True,
                                       capture_output=True).stdout)
            if name.endswith(".c"):
                srcs.append(os.path.join(d, name))
    out = os.path.join(d, "base.so")
    flags = [f for f in kernels.build._FLAGS]
    subprocess.run([kernels._compiler(), *flags, *srcs, "-o", out], check=True)
    lib = ctypes.CDLL(out)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("iterserve_qgemm", "iterserve_gemm"):
        fn = getattr(lib, name)
        fn.restype = None if name == "iterserve_qgemm" else i32
        fn.argtypes = [i64, p, i64, i64, i64, p, i64, i64, p, i64, i32]
    if hasattr(lib, "iterserve_configure"):         # one configuration, set once
        from iterserve.model.kernels._abi import Config
        lib.iterserve_configure.restype, lib.iterserve_configure.argtypes = None, [p]
        lib.iterserve_configure(ctypes.byref(Config(0, 0, 0)))
    else:                                             # a tree with per-file ISA setters
        lib.iterserve_gemm_isa.restype, lib.iterserve_gemm_isa.argtypes = i64, [i64]
        lib.iterserve_gemm_isa(0)
    return lib


def ab(rows_list: list[int], rounds: int, types_: list[str], shapes: list[str], rev: str,
       fn_name: str) -> dict:
    """This tree's `qgemm` (fn_name "qgemm": what every decode step calls) or `gemm` (the
    prefill panel GEMM) against the same function of revision `rev`, same process,
    alternating; for `gemm` also oneDNN over a prepacked float32 copy (a float prefill).
    Both libraries use the best ISA of the CPU."""
    import sys
    sys.path.insert(0, "tests")
    from fixtures.gguf_blocks import gguf_blocks
    from iterserve.model import kernels
    base = _baseline_lib(rev)
    kernels.gemm_isa(None)
    threads = torch.get_num_threads()
    clock = time.thread_time if threads == 1 else time.perf_counter

    def med_us(fn, reps):
        ts = []
        for _ in range(reps):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
        return statistics.median(ts) * 1e6

    result = {"threads": threads, "clock": clock.__name__, "baseline": rev, "function": fn_name,
              "isa": kernels.gemm_isa(None), "cases": []}
    for name in types_:
        for group in shapes:
            for n, k in KQ_SHAPES[group]:
                blk = 256 if name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS") else 32
                if k % blk:
                    continue
                t, raw, w = gguf_blocks(name, n, k)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 8) if fn_name == "gemm" else None
                del w
                for m in rows_list:
                    x, out = torch.randn(m, k), torch.empty(m, n)
                    args = (t, raw.data_ptr(), n, raw.shape[1], k, x.data_ptr(), m, k,
                            out.data_ptr(), n, threads)
                    new_fn = kernels._library().iterserve_qgemm if fn_name == "qgemm" \
                        else kernels._library().iterserve_gemm
                    old_fn = getattr(base, f"iterserve_{fn_name}")
                    fns = {"new": lambda: new_fn(*args), "old": lambda: old_fn(*args)}
                    if packed is not None:
                        fns["prepacked_f32"] = lambda: torch.ops.mkldnn._linear_pointwise(
                            x, packed, None, "none", [], "")
                    reps = max(3, min(50, int(3e4 / max(1.0, raw.numel() / 2e4 * m ** 0.5))))
                    for f in fns.values():
                        f()
                    got = {key: [] for key in fns}
                    for _ in range(rounds):
                        for key, f in fns.items():
                            got[key].append(med_us(f, reps))
                    us = {key: statistics.median(v) for key, v in got.items()}
                    case = {"type": name, "group": group, "n": n, "k": k, "m": m,
                            **{f"{key}_us": round(v, 1) for key, v in us.items()},
                            "old_over_new": round(us["old"] / us["new"], 3)}
                    if packed is not None:
                        case["prepacked_over_new"] = round(us["prepacked_f32"] / us["new"], 3)
                        case["prepacked_over_old"] = round(us["prepacked_f32"] / us["old"], 3)
                    result["cases"].append(case)
                    print(f"{name:5s} {n:5d}x{k:<5d} M={m:3d} " + "  ".join(
                        f"{key} {v:9.0f}" for key, v in us.items()) + "  " + "  ".join(
                        f"{key} {val}" for key, val in case.items() if "_over_" in key),
                        flush=True)
                del packed
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="layout", choices=["layout", "types", "prefill", "paths", "ab"])
    ap.add_argument("--types", default="Q4_1", help="prefill: types on the bundled shapes")
    ap.add_argument("--big-types", default="Q4_0,Q4_K", help="prefill: types on 1.7B shapes")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--shapes", default="1.7B,bundled", help="paths/ab: shape groups")
    ap.add_argument("--baseline-rev", default="9482085", help="ab: the git revision to compare")
    ap.add_argument("--function", default="qgemm", choices=["qgemm", "gemm"], help="ab")
    ap.add_argument("--variants", default="avx2,avx512,generic,panel",
                    help="paths: avx2, avx512, generic, panel, auto")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, help="torch/kernel threads (default: torch's); 1 is "
                    "far less noisy on a loaded machine (a descheduled OpenMP thread stalls "
                    "the other at the barrier for a whole time slice)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    if a.what == "ab":
        res = ab(rows, a.rounds, a.types.split(","), a.shapes.split(","), a.baseline_rev,
                 a.function)
    elif a.what == "paths":
        res = paths(rows, a.rounds, a.types.split(","), a.shapes.split(","),
                    a.variants.split(","))
    elif a.what == "prefill":
        res = prefill(rows, a.rounds, a.types.split(","), [t for t in a.big_types.split(",") if t])
    else:
        res = layout(rows, a.rounds) if a.what == "layout" else types(rows, a.rounds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
