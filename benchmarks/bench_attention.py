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
- `ab`: the attention kernels of this tree against those of a git revision (`--baseline`;
  its decode_attention.c and prefill_attention.c built into a library of their own), called
  alternately in one process on the same pools: decode steps (sequences x contexts) and
  prefill chunks (chunk sizes x contexts), medians and the baseline/current ratio. This is
  how the cost of the batch-invariant order (attention_core.h) was measured.

    python benchmarks/bench_attention.py kernel [--shape 9/3/64] [--repeats 15]
    python benchmarks/bench_attention.py engine [--model PATH] [--chunk 128] [--context 1500]
    python benchmarks/bench_attention.py ab --baseline REV [--shape 1.7b] [--kv-dtype float16]
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


def _baseline_library(rev: str):
    """ctypes handle of `rev`'s decode_attention.c + prefill_attention.c (and the headers they
    include), compiled with the kernels' own flags into a temporary library; the CPU feature
    probe they call is copied from `rev`'s abi.c."""
    import ctypes
    import subprocess
    import tempfile
    root = Path(__file__).resolve().parents[1]
    kdir = "src/iterserve/model/kernels"
    tmp = Path(tempfile.mkdtemp(prefix="attn-baseline-"))
    names = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", f"{rev}:{kdir}"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".h", ".c")):
            blob = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{kdir}/{name}"],
                                  check=True, capture_output=True).stdout
            (tmp / name).write_bytes(blob)
    abi = (tmp / "abi.c").read_text()
    probe = abi[abi.index("int64_t iterserve_cpu_features(void)"):]
    (tmp / "probe.c").write_text('#include <cpuid.h>\n#include <stdint.h>\n' + probe)
    srcs = [str(tmp / n) for n in ("decode_attention.c", "prefill_attention.c", "probe.c")]
    flags = [f for f in kernels._FLAGS]
    so = tmp / "baseline.so"
    subprocess.run([kernels._compiler(), *flags, *srcs, "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    # (a revision before attention sinks takes one argument fewer; the trailing NULL sinks
    # pointer is then ignored by the calling convention)
    for name in ("iterserve_decode_attention_kv", "iterserve_prefill_attention"):
        fn, ref = getattr(lib, name), getattr(kernels._lib(), name)
        fn.restype, fn.argtypes = ref.restype, ref.argtypes
    return lib


def bench_ab(shape: str, baseline: str, batches: list[int], contexts: list[int],
             chunks: list[int], repeats: int, kv_dtype: torch.dtype) -> list[dict]:
    H, kvh, d = (int(x) for x in SHAPES.get(shape, shape).split("/"))
    bs, scale = 16, d ** -0.5
    base, cur = _baseline_library(baseline), kernels._lib()
    kvt = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[kv_dtype]
    threads = torch.get_num_threads()
    rows = []

    def timed(calls: dict) -> dict:
        t = {n: [] for n in calls}
        for r in range(repeats + 1):
            order = list(calls) if r % 2 == 0 else list(reversed(calls))
            for name in order:
                t0 = time.perf_counter()
                rc = calls[name]()
                dt = time.perf_counter() - t0
                if rc:
                    raise SystemExit(f"{name} kernel returned {rc}")
                if r:
                    t[name].append(dt)
        return {n: _median_ms(x) for n, x in t.items()}

    i32 = dict(dtype=torch.int32)
    for L in contexts:
        g = torch.Generator().manual_seed(L)
        cases = [("decode", D, 1) for D in batches if kv_dtype != torch.bfloat16] \
            + [("prefill", 1, C) for C in chunks]
        for kind, D, C in cases:
            nb = D * ((L + C + bs - 1) // bs)
            blocks = list(range(nb))
            random.Random(L + D + C).shuffle(blocks)
            per = nb // D
            pk = torch.randn(nb * bs, kvh * d, generator=g).to(kv_dtype)
            pv = torch.randn(nb * bs, kvh * d, generator=g).to(kv_dtype)
            tables = torch.tensor([blocks[i * per:(i + 1) * per] for i in range(D)], **i32)
            q = torch.randn(D * C, H, d, generator=g)
            outs = {"baseline": torch.empty_like(q), "current": torch.empty_like(q)}
            if kind == "decode":
                lens = torch.full((D,), L + 1, **i32)

                def call(lib, out):
                    return lambda: lib.iterserve_decode_attention_kv(
                        q.data_ptr(), pk.data_ptr(), pv.data_ptr(), pk.shape[0],
                        tables.data_ptr(), tables.shape[1], lens.data_ptr(), 0, D, H, kvh, d,
                        bs, scale, out.data_ptr(), threads, kvt, None)
            else:
                qs, ctx, ql = (torch.tensor([v], **i32) for v in (0, L, C))

                def call(lib, out):
                    return lambda: lib.iterserve_prefill_attention(
                        q.data_ptr(), pk.data_ptr(), pv.data_ptr(), pk.shape[0], 1,
                        qs.data_ptr(), ctx.data_ptr(), ql.data_ptr(), tables.data_ptr(),
                        tables.shape[1], 0, H, kvh, d, bs, scale, out.data_ptr(), threads,
                        kvt, 0, None)
            med = timed({"baseline": call(base, outs["baseline"]),
                         "current": call(cur, outs["current"])})
            row = {"kind": kind, "seqs": D, "chunk": C, "context": L,
                   "baseline_ms": med["baseline"], "current_ms": med["current"],
                   "current_over_baseline": round(med["current"] / med["baseline"], 3),
                   "max_abs_diff": float((outs["baseline"] - outs["current"]).abs().max())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=("kernel", "engine", "ab"))
    ap.add_argument("--baseline", default=None, help="ab: the git revision to compare with")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32],
                    help="ab: decode sequences per step")
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
    if a.part == "ab":
        if not a.baseline:
            ap.error("ab needs --baseline REV")
        rows = bench_ab(a.shape, a.baseline, a.batches, a.contexts, a.chunks, a.repeats,
                        getattr(torch, a.kv_dtype))
    elif a.part == "kernel":
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
