"""Prefill throughput of the engine on the bundled model, two source trees alternating.

Why: a change to the prefill GEMM (kernels/prefill.c) or what feeds it is judged end to end
against another commit (check it out with `git worktree add`); this checks the effect
(embedding, every layer, attention over the paged cache, LM head of the last tokens) rather
than one GEMM. Each measurement is a fresh process of one tree (`--tree`, its `src` on the
path) that warms up, then prefills `--requests` prompts of `--tokens` tokens with
max_tokens=1 through `LLMEngine.step` (chunked prefill, the default budget) and reports
prompt tokens/s; the trees alternate A, B, A, B ... and the medians are compared, so load on
a shared machine hits both alike.

    python benchmarks/bench_prefill.py --tree old=/tmp/old --tree new=. [--rounds 5]
    python benchmarks/bench_prefill.py --child          # one measurement of this tree

`--gemm` instead measures the prefill GEMM alone, in one process: the int8-activation GEMM
(prefill8.c, `kernels.gemm_int8`) against the float panel GEMM (prefill.c, `kernels.gemm` in
float mode) on the SmolLM2-1.7B layer shapes, alternating int8 / float per repeat, medians of
wall and of process CPU time, GFLOP/s (2 M N K per call) and the ratio float time / int8 time:

    python benchmarks/bench_prefill.py --gemm [--types Q4_K Q6_K Q4_0 Q8_0] [--rows 64 128 256 512]
        [--threads 1] [--repeats 7] [--out benchmarks/results/i8gemm-prefill-gemm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(requests: int, tokens: int, reps: int, threads: int) -> dict:
    import torch
    if threads:
        torch.set_num_threads(threads)
    from iterserve.bench.workloads import make_prompt
    from iterserve.core.request import SamplingParams
    from iterserve.engine.args import EngineArgs
    from iterserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(max_num_seqs=8))
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(tag: str) -> tuple[float, int]:
        prompts = [make_prompt(tokens, rng) for _ in range(requests)]
        n = 0
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}{i}", p, sp)
        t, c = time.perf_counter(), time.thread_time()
        done = 0
        while done < requests:
            for out in engine.step():
                if out.finished:
                    done += 1
                    n += len(out.prompt_token_ids)
        return time.perf_counter() - t, time.thread_time() - c, n
    run("warm")
    rates, cpu_rates = [], []
    for r in range(reps):
        dt, dc, n = run(f"r{r}-")
        rates.append(n / dt)
        cpu_rates.append(n / dc)
    # with --threads 1 every op runs on this thread: tokens per CPU second of it is the
    # figure a loaded machine disturbs least
    return {"prompt_tok_s": statistics.median(rates), "all": rates,
            "prompt_tok_per_thread_cpu_s": statistics.median(cpu_rates)}


def profile(model: str, tokens: int, modes: list[str], threads: int, reps: int) -> dict:
    """Where one `tokens`-token prefill (one request, max_tokens=1) spends its time, per
    activation mode: wall time of the step (median of `reps`), then one step under cProfile
    with the time of each function itself (tottime; a ctypes kernel call is the time of its
    Python wrapper, e.g. kernels.gemm)."""
    import cProfile
    import pstats
    import torch
    if threads:
        torch.set_num_threads(threads)
    from iterserve.core.request import SamplingParams
    from iterserve.engine.args import EngineArgs
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.model import kernels
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=1,
                                                   max_num_batched_tokens=max(512, tokens),
                                                   kv_cache_memory=0.25))
    rng = random.Random(0)
    doc = {"kind": "prefill-profile", "model": model, "tokens": tokens,
           "threads": torch.get_num_threads(), "modes": {}}

    def one(tag: str) -> float:
        ids = [rng.randrange(100, 20000) for _ in range(tokens)]
        engine.add_request(tag, ids, sp)
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t
    n = 0
    for mode in modes:
        kernels.set_activations(mode)
        one(f"warm-{mode}")
        walls = []
        for _ in range(reps):
            n += 1
            walls.append(one(f"r{n}"))
        prof = cProfile.Profile()
        n += 1
        prof.enable()
        one(f"p{n}")
        prof.disable()
        st = pstats.Stats(prof)
        total = sum(v[2] for v in st.stats.values())
        top = sorted(((v[2], f"{Path(k[0]).name}:{k[2]}") for k, v in st.stats.items()),
                     reverse=True)[:20]
        key = mode if mode not in doc["modes"] else f"{mode}#{len(doc['modes'])}"
        doc["modes"][key] = {"wall_s": walls, "median_s": statistics.median(walls),
                              "profile_total_s": total,
                              "top_tottime": [{"fn": f, "s": round(t, 4),
                                               "share": round(t / total, 3)} for t, f in top]}
        print(f"{mode}: {tokens}-token prefill median {statistics.median(walls) * 1e3:.0f} ms "
              f"(all {', '.join(f'{w * 1e3:.0f}' for w in walls)})", flush=True)
        for t, f in top[:12]:
            print(f"   {t * 1e3:8.1f} ms {t / total:6.1%}  {f}")
    doc["load_avg_at_end"] = os.getloadavg()
    return doc


# SmolLM2-1.7B's GEMM shapes (n, k): q/k/v/o, gate/up, down
GEMM_SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192)]


def gemm_ab(types: list[str], rows: list[int], threads: int, repeats: int,
            shapes: list[tuple[int, int]]) -> dict:
    """Same-process A/B of the int8 and float prefill GEMMs (see the module docstring)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fixtures.tiny_gguf import random_blocks

    from iterserve.model import kernels
    if threads:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    res = {"kind": "prefill-gemm-ab", "threads": torch.get_num_threads(),
           "int8_isa": kernels.int8_isa(), "gemm_isa": kernels.gemm_isa(), "rows": rows,
           "shapes": shapes, "repeats": repeats, "results": []}
    for name in types:
        t = int(GGMLQuantizationType[name])
        for n, k in shapes:
            # random blocks with sane f16 scales: speed does not depend on the values
            w = torch.from_numpy(random_blocks(name, n, k, rng))
            for m in rows:
                x = torch.randn(m, k)
                out = torch.empty(m, n)

                def f8():
                    kernels.gemm_int8(t, w, k, x, out)

                def ff():
                    kernels.gemm(t, w, k, x, out)
                kernels.set_activations("float")
                f8(), ff()
                times = {"int8": [], "float": []}
                cpus = {"int8": [], "float": []}
                for _ in range(repeats):
                    for tag, fn in (("int8", f8), ("float", ff)):
                        t0, c0 = time.perf_counter(), time.process_time()
                        fn()
                        times[tag].append(time.perf_counter() - t0)
                        cpus[tag].append(time.process_time() - c0)
                med = {tag: statistics.median(v) for tag, v in times.items()}
                medc = {tag: statistics.median(v) for tag, v in cpus.items()}
                flop = 2.0 * m * n * k
                row = {"type": name, "n": n, "k": k, "rows": m,
                       "gflops_int8": flop / med["int8"] / 1e9,
                       "gflops_float": flop / med["float"] / 1e9,
                       "speedup_wall": med["float"] / med["int8"],
                       "speedup_cpu": medc["float"] / medc["int8"],
                       "wall_s": times, "cpu_s": cpus}
                res["results"].append(row)
                print(f"{name} {n}x{k} rows {m}: int8 {row['gflops_int8']:.0f} GFLOP/s, float "
                      f"{row['gflops_float']:.0f}; float/int8 wall {row['speedup_wall']:.2f}x, "
                      f"cpu {row['speedup_cpu']:.2f}x", flush=True)
    res["load_avg_at_end"] = os.getloadavg()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemm", action="store_true", help="the GEMM A/B (int8 vs float)")
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q4_0", "Q8_0"])
    ap.add_argument("--rows", nargs="+", type=int, default=[64, 128, 256, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shapes", nargs="+", default=None, help="NxK (default the 1.7B shapes)")
    ap.add_argument("--profile", metavar="MODEL", help="profile one prefill of --tokens "
                    "tokens of this model (a .gguf / HF dir) per --modes")
    ap.add_argument("--modes", nargs="+", default=["float", "auto"])
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per process")
    ap.add_argument("--rounds", type=int, default=5, help="processes per tree")
    ap.add_argument("--threads", type=int, default=0, help="torch/kernel threads (default: "
                    "torch's); 1 is far less noisy on a loaded machine, where a descheduled "
                    "OpenMP thread stalls every op at its barrier")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.profile:
        doc = profile(a.profile, a.tokens, a.modes, a.threads, a.reps)
        if a.out:
            Path(a.out).write_text(json.dumps(doc, indent=1))
        return 0
    if a.gemm:
        shapes = ([tuple(int(v) for v in sh.split("x")) for sh in a.shapes] if a.shapes
                  else GEMM_SHAPES)
        doc = gemm_ab(a.types, a.rows, a.threads, a.repeats, shapes)
        if a.out:
            Path(a.out).write_text(json.dumps(doc, indent=1))
        return 0
    if a.child:
        print(json.dumps(child(a.requests, a.tokens, a.reps, a.threads)))
        return 0
    trees = dict(t.split("=", 1) for t in a.tree) or {"this": str(Path(__file__).parents[1])}
    res: dict[str, list[float]] = {k: [] for k in trees}
    cpu: dict[str, list[float]] = {k: [] for k in trees}
    for r in range(a.rounds):
        for name, path in trees.items():
            env = dict(os.environ, PYTHONPATH=str(Path(path).resolve() / "src"))
            out = subprocess.run([sys.executable, __file__, "--child", "--requests",
                                  str(a.requests), "--tokens", str(a.tokens), "--reps",
                                  str(a.reps), "--threads", str(a.threads)], env=env, capture_output=True, text=True,
                                 check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            v, vc = got["prompt_tok_s"], got["prompt_tok_per_thread_cpu_s"]
            res[name].append(v)
            cpu[name].append(vc)
            print(f"round {r} {name}: {v:.0f} prompt tok/s, {vc:.0f} per thread-CPU s",
                  flush=True)
    doc = {"kind": "prefill-ab", "requests": a.requests, "tokens": a.tokens, "trees": trees,
           "threads": a.threads or "torch default", "load_avg_at_end": os.getloadavg(),
           "prompt_tok_s": res, "median": {k: statistics.median(v) for k, v in res.items()},
           "prompt_tok_per_thread_cpu_s": cpu,
           "median_per_thread_cpu_s": {k: statistics.median(v) for k, v in cpu.items()}}
    names = list(trees)
    doc["ratio_to_first"] = {k: doc["median"][k] / doc["median"][names[0]] for k in names}
    doc["cpu_ratio_to_first"] = {k: doc["median_per_thread_cpu_s"][k]
                                 / doc["median_per_thread_cpu_s"][names[0]] for k in names}
    print(json.dumps({k: doc[k] for k in ("median", "ratio_to_first", "cpu_ratio_to_first")}))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
