"""Same-process A/B of prefill-chunk attention: the torch path (index_select of the context
from the KV pools + SDPA with an explicit mask; `is_causal` at context 0) against the native
kernel (kernels/prefill_attention.c, through the block tables).

Why: a 128-token chunk at context 1500 cost 220 ms on the real engine (bundled 135M model)
against 139 ms at the lab's linear price; at context 0 the two agreed. Two parts:

- `kernel`: one layer's `paged_attention` (new K/V written + attention) for chunk sizes x
  contexts at a model's attention shape, torch ("old") and kernel ("new") alternating in
  one process (and the AVX2 and AVX-512 builds of the kernel), medians; plus the per-step
  metadata build.
- `engine`: `ModelRunner.execute` of one prefill chunk at a context (the whole forward: all
  layers, the LM head), torch and kernel alternating on one runner (attention.PREFILL_NATIVE
  toggled between steps), medians.

    python benchmarks/bench_attention.py kernel [--shape 9/3/64] [--repeats 15]
    python benchmarks/bench_attention.py engine [--model PATH] [--chunk 128] [--context 1500]
    add --out benchmarks/results/attn-NAME.json to keep the numbers

Under load only the same-run ratios mean anything; OMP_WAIT_POLICY=PASSIVE helps there.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from iterserve.model import attention, kernels  # noqa: E402

SHAPES = {"135m": "9/3/64", "1.7b": "32/32/64", "llama-1b": "32/8/64", "qwen-1.5b": "12/2/128"}


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def bench_kernel(shape: str, chunks: list[int], contexts: list[int], repeats: int,
                 kv_dtype: torch.dtype, window: int | None) -> list[dict]:
    H, kvh, d = (int(x) for x in SHAPES.get(shape, shape).split("/"))
    bs, scale, cpu = 16, d ** -0.5, torch.device("cpu")
    fn = kernels.decode_attention()
    if fn is None:
        raise SystemExit(f"native kernels unavailable: {kernels.unavailable}")
    isas = ["avx2"] + (["avx512"] if kernels.prefill_attention_isa(d, "avx512") == "avx512" else [])
    rows = []
    for C in chunks:
        for L in contexts:
            nb = (L + C + bs - 1) // bs
            g = torch.Generator().manual_seed(C + L)
            blocks = list(range(nb))
            random.Random(0).shuffle(blocks)
            pk = torch.randn(nb * bs, kvh * d, generator=g).to(kv_dtype)
            pv = torch.randn(nb * bs, kvh * d, generator=g).to(kv_dtype)
            q = torch.randn(C, H, d, generator=g)
            k, v = torch.randn(C, kvh, d, generator=g), torch.randn(C, kvh, d, generator=g)
            seqs = [(L, C, blocks)]
            meta_old = attention.build_metadata(seqs, bs, window, cpu, torch.float32)
            meta_new = attention.build_metadata(seqs, bs, window, cpu, torch.float32,
                                                decode_kernel=fn)
            assert meta_new.prefill_chunks is not None and meta_old.prefill_chunks is None
            out = torch.empty_like(q)
            chunks = meta_new.prefill_chunks
            ref = attention.paged_attention(q, k, v, pk, pv, meta_old, scale)
            err = {}
            for isa in isas:
                chunks.run(q, pk, pv, scale, out, isa=isa)
                err[isa] = float((out - ref).abs().max())
            t = {n: [] for n in ("old", "new", *isas, "meta_old", "meta_new")}
            for r in range(repeats):
                order = ["old", "new", *isas]
                if r % 2:
                    order.reverse()
                for name in order:
                    t0 = time.perf_counter()
                    if name == "old":
                        attention.paged_attention(q, k, v, pk, pv, meta_old, scale)
                    elif name == "new":
                        attention.paged_attention(q, k, v, pk, pv, meta_new, scale)
                    else:
                        chunks.run(q, pk, pv, scale, out, isa=name)
                    t[name].append(time.perf_counter() - t0)
                for name, kern in (("meta_old", None), ("meta_new", fn)):
                    t0 = time.perf_counter()
                    attention.build_metadata(seqs, bs, window, cpu, torch.float32,
                                             decode_kernel=kern)
                    t[name].append(time.perf_counter() - t0)
            row = {"chunk": C, "context": L, **{f"{n}_ms": _median_ms(x) for n, x in t.items()},
                   "max_abs_err": err}
            row["old_over_new"] = round(row["old_ms"] / row["new_ms"], 2)
            flops = 4 * C * (L + (C + 1) / 2) * d * H
            row["new_gflops"] = round(flops / (row["new_ms"] * 1e-3) / 1e9, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def bench_engine(model: str | None, chunk: int, contexts: list[int], repeats: int) -> list[dict]:
    from iterserve.core.request import SamplingParams
    from iterserve.core.scheduler_output import NewRequestData, SchedulerOutput
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner

    loaded = load_model(model)
    bs = 16
    nb = max((L + chunk + bs - 1) // bs for L in contexts)
    runner = ModelRunner(loaded, num_blocks=nb, block_size=bs)
    if runner.decode_kernel is None:
        raise SystemExit("the runner's native attention is off (needs CPU float32 and "
                         "float32/f16 KV)")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    rows = []
    for L in contexts:
        prompt = [rng.randrange(3, loaded.config.vocab_size) for _ in range(L + chunk)]
        blocks = tuple(range((L + chunk + bs - 1) // bs))

        def out(i: int) -> SchedulerOutput:
            # sent whole each time (as after a recompute preemption): one chunk at context L
            rid = f"b-{L}-{i}"
            return SchedulerOutput(step=i, scheduled_new_reqs=[
                NewRequestData(rid, prompt, params, blocks, L)],
                num_scheduled_tokens={rid: chunk}, num_batched_tokens=chunk)

        t = {"old": [], "new": [], "old_cpu": [], "new_cpu": []}
        tokens = {}
        for r in range(repeats + 1):
            order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
            for name in order:
                attention.PREFILL_NATIVE = name == "new"
                o = out(r)
                c0, t0 = time.process_time(), time.perf_counter()
                res = runner.execute(o)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if r:                                      # round 0 is the warm-up
                    t[name].append(dt)
                    t[name + "_cpu"].append(dc)
                tokens.setdefault(name, set()).add(next(iter(res.values())).token_id)
        attention.PREFILL_NATIVE = True
        # wall time, and the process's CPU time (all threads): under load the CPU time is
        # the steadier measure of the work done
        row = {"chunk": chunk, "context": L, **{f"{n}_ms": _median_ms(x) for n, x in t.items()},
               "old_all_ms": [round(x * 1e3, 1) for x in t["old"]],
               "new_all_ms": [round(x * 1e3, 1) for x in t["new"]],
               "same_token": tokens["old"] == tokens["new"]}
        row["old_over_new"] = round(row["old_ms"] / row["new_ms"], 3)
        row["cpu_old_over_new"] = round(row["old_cpu_ms"] / row["new_cpu_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=("kernel", "engine"))
    ap.add_argument("--shape", default="135m",
                    help=f"H/kvh/d or one of {', '.join(SHAPES)} (kernel)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--contexts", type=int, nargs="+", default=[0, 512, 1500, 4096])
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--window", type=int, default=None, help="sliding window (kernel)")
    ap.add_argument("--model", default=None, help="engine: a model path (default bundled)")
    ap.add_argument("--chunk", type=int, default=128, help="engine: chunk size")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.part == "kernel":
        rows = bench_kernel(a.shape, a.chunks, a.contexts, a.repeats, getattr(torch, a.kv_dtype),
                            a.window)
    else:
        rows = bench_engine(a.model, a.chunk, a.contexts, a.repeats)
    res = {"part": a.part, "args": vars(a), "threads": torch.get_num_threads(),
           "load_before_after": os.getloadavg(), "rows": rows,
           "isa": kernels.prefill_attention_isa(64), "features": sorted(kernels.features())}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
