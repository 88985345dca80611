"""bf16 dot products (kernels/bf16dot.c) against the float path for BF16 / F16 weights, same
process, alternating.

For SmolLM2-1.7B shapes (q/o 2048x2048, gate_up 16384x2048, down 2048x8192) and row counts,
times, alternating `--repeats` times and keeping each side's median:
- "float": `kernels.qgemm` in the float activation mode (the float register kernel at 1-2
  rows, the float32 panel GEMM from 3 rows on); for prefill rows (> 32) `kernels.gemm` in
  float mode (what layers.py calls there);
- "bf16": `kernels.qgemm_bf16` (path auto: the bf16 decode kernel below 16 rows, the bf16
  panel GEMM from 16), also "bf16_decode" and "bf16_panel" forced, for the row threshold;
- "torch": torch's own bf16 matmul (oneDNN, avx512bf16) of x.bfloat16() @ W^T, then .float()
  (bf16 output rounding), for the prefill comparison.
Decode rows report GB/s of weight bytes streamed; prefill rows GFLOP/s (2 M N K / s). F16
weights at decode rows (<= 32): "auto" = `qgemm` in the auto mode (f16dot.c's streamed
kernel up to 16 rows), "stream512" / "stream2" the streamed kernel forced on AVX-512 / AVX2
at any row count, and "float_panel" prefill.c's float32 panel, for the row limit. `--shapes
gate` is one 8192x2048 gate / up segment (what a GGUF's step multiplies; `gate_up` the
fused pair of a checkpoint).

An A/B against the kernels of another commit runs this script (or `--e2e`) in a second
worktree of that commit (`git worktree add ../ab <commit>`), alternating runs of the two
trees with the same arguments: the product keeps no switch for superseded kernels.

    PYTHONPATH=src python benchmarks/bench_bf16.py --types F16 --shapes qo gate down \
        --rows 1 2 4 8 12 16 24 --repeats 7 --threads 2          # ~3 min

Under load: medians of alternating repeats; threads via --threads (default 1: CPU time).

    PYTHONPATH=src python benchmarks/bench_bf16.py --quick   # ~1 min
    PYTHONPATH=src python benchmarks/bench_bf16.py           # ~4-6 min

`--e2e MODEL --mix-split` runs `mix` (16 requests at --batch slots) offline and times every
engine step: the share of prefill steps vs decode-only steps (by batch size) in `mix`:

    PYTHONPATH=src python benchmarks/bench_bf16.py --e2e ~/.cache/iterserve-models/\
        smollm2-1.7b/hf-bf16 --mix-split --batch 8 --threads 2

`--e2e MODEL` instead runs greedy generation of `--batch` sequences through the offline LLM,
float and auto (bf16 dot for BF16 weights) alternating (bench_int8.decode_ab), and reports
the peak RSS beside the file size (the weights must stay bf16: ~1 x the file, not 2x):

    PYTHONPATH=src python benchmarks/bench_bf16.py --e2e ~/.cache/iterserve-models/\
        smollm2-1.7b/hf-bf16 --batch 8 --steps 16 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from iterserve.model import kernels

from _timing import time_call  # noqa: E402  (benchmarks/ is the script's directory)

SHAPES = {"qo": (2048, 2048), "gate": (8192, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
BF16, F16 = 30, 1


def _time(fn, min_s: float) -> float:
    """Seconds per call (at least two timed calls): the shared loop in benchmarks/_timing.py."""
    return time_call(fn, min_s, min_calls=2)


def _weight(t: int, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16 if t == BF16 else torch.float16)
    return w.view(torch.uint8).view(n, 2 * k)


def f16_variants(w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor) -> dict:
    """F16 decode rows: "auto" = `qgemm` in the auto mode (the streamed kernel up to 16
    rows), "stream512" / "stream2" the streamed kernel forced (AVX-512 / AVX2) at any row
    count, "float_panel" prefill.c's float32 panel (kernels.gemm in float mode), for the row
    limit."""
    def q():
        kernels.set_activations("auto")
        kernels.qgemm(F16, w, k, x, out)

    def forced(isa):
        return lambda: kernels.qgemm_f16(w, k, x, out, 0, isa)

    def float_panel():
        kernels.set_activations("float")
        kernels.gemm(F16, w, k, x, out)
    v = {"float_panel": float_panel, "auto": q, "stream512": forced("avx512")}
    v["stream2"] = forced("avx2")
    return v


def variants(t: int, w: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor, torch_too: bool):
    m = x.shape[0]
    if t == F16 and m <= 32:
        return f16_variants(w, k, x, out)

    def old():
        kernels.set_activations("float")
        (kernels.qgemm if m <= 32 else kernels.gemm)(t, w, k, x, out)

    def new(path="auto"):
        return lambda: kernels.qgemm_bf16(t, w, k, x, out, 0, path)

    v = {"float": old, "bf16": new()}
    if m <= 32:
        v["bf16_decode"], v["bf16_panel"] = new("decode"), new("panel")
    if torch_too and t == BF16:
        wt = w.view(torch.bfloat16)

        def tmm():
            out.copy_(torch.mm(x.bfloat16(), wt.t()))
        v["torch"] = tmm
    return v


def mix_split(model: str, slots: int, threads: int) -> dict:
    """The `mix` workload (16 requests, all at once, `slots` sequences) through the offline
    engine, every engine step timed: the share of time in steps that prefill (any prompt
    tokens) vs decode-only steps, and decode steps by batch size. Says what `mix` measures
    for a model: a compute-bound prefill GEMM or the bandwidth-bound decode kernels."""
    from iterserve import LLM, SamplingParams
    from iterserve.bench.workloads import build_workload
    torch.set_num_threads(threads)
    reqs = build_workload("mix", num_requests=16).requests
    ctx = 1024                       # run_models' sizing: every slot its whole context, so
    llm = LLM(model=model, max_num_seqs=slots, max_model_len=ctx,    # nothing is preempted
              num_kv_blocks=-(-slots * ctx // 16) + slots)
    eng = llm.engine
    steps: list[tuple[float, int, int]] = []       # (seconds, batched tokens, sequences)
    schedule, step = eng.scheduler.schedule, eng.step
    last: list = []

    def sched():
        out = schedule()
        last[:] = [out]
        return out

    def timed_step():
        t0 = time.perf_counter()
        res = step()
        o = last[0] if last else None
        if o is not None and o.num_batched_tokens:
            steps.append((time.perf_counter() - t0, o.num_batched_tokens, len(o.num_scheduled_tokens)))
        return res
    eng.scheduler.schedule, eng.step = sched, timed_step
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    pre = [s for s in steps if s[1] > s[2]]
    dec = [s for s in steps if s[1] == s[2]]
    by_batch: dict[int, list[float]] = {}
    for s in dec:
        by_batch.setdefault(s[2], []).append(s[0])
    tot = sum(s[0] for s in steps)
    return {"model": model, "slots": slots, "threads": threads, "wall_s": round(wall, 3),
            "output_tokens": out_toks, "output_tok_s": round(out_toks / wall, 3),
            "steps": len(steps), "prefill_steps": len(pre), "decode_steps": len(dec),
            "preemptions": sum(o.metrics.num_preemptions for o in outs if getattr(o, "metrics", None)
                               and hasattr(o.metrics, "num_preemptions")),
            "prefill_share": round(sum(s[0] for s in pre) / tot, 4),
            "prefill_step_tokens": sum(s[1] for s in pre),
            "decode_steps_by_batch": {b: {"steps": len(v), "ms_median": round(1e3 * statistics.median(v), 2),
                                          "s_total": round(sum(v), 3)}
                                      for b, v in sorted(by_batch.items())}}


def mix_bound(profile: str, slots: int, peak_gflops: float, prefill_gflops: float,
              peers: dict[str, float]) -> dict:
    """The bandwidth bound of `mix` for a model: the decode steps of `mix` at `slots` slots
    (simulated like the scheduler runs them: all requests at t=0, first come first served,
    one token per running sequence per step; the engine's own count is in --mix-split), each
    reading every weight byte once (the weight bytes per step and the measured bandwidth of a
    profile_decode.py --bandwidth JSON), plus the prompt tokens' FLOPs at `prefill_gflops`
    (what the prefill GEMM reaches) and at `peak_gflops` (the instruction's peak). Output
    tokens over that time is the most any engine can reach on this machine without reading
    fewer weight bytes per step; `peers` (name=tok/s) are shown as fractions of it."""
    from iterserve.bench.workloads import build_workload
    prof = json.loads(Path(profile).read_text())
    wbytes = prof["weight_bytes_per_step"]
    step_bytes = sum(wbytes["types"].values()) + wbytes.get("lm_head", 0)
    gbs = prof["bandwidth_gbs_best"]
    reqs = build_workload("mix", num_requests=16).requests
    queue, running, steps, by_batch = [r.max_tokens - 1 for r in reqs], [], 0, {}
    while queue or running:                 # the prefill step samples each one's 1st token
        while queue and len(running) < slots:
            running.append(queue.pop(0))
        running = [x for x in running if x > 0]
        if not running:
            continue
        by_batch[len(running)] = by_batch.get(len(running), 0) + 1
        steps += 1
        running = [x - 1 for x in running]
    out_tokens = sum(r.max_tokens for r in reqs)
    prompt_tokens = None
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(prof["model"])
        prompt_tokens = sum(len(tok(r.prompt)["input_ids"]) for r in reqs)
    except Exception:                                   # no HF tokenizer: words as tokens
        prompt_tokens = sum(r.prompt_len for r in reqs)
    flop_per_token = step_bytes                          # bf16: 2 bytes = 1 MAC = 2 FLOPs
    decode_s = steps * step_bytes / (gbs * 1e9)
    pre_s = prompt_tokens * flop_per_token / (prefill_gflops * 1e9)
    pre_peak_s = prompt_tokens * flop_per_token / (peak_gflops * 1e9)
    bound = out_tokens / (decode_s + pre_s)
    return {"profile": profile, "slots": slots, "weight_bytes_per_step": step_bytes,
            "bandwidth_gbs": gbs, "step_ms_bound": round(1e3 * step_bytes / (gbs * 1e9), 2),
            "decode_steps": steps, "decode_steps_by_batch": dict(sorted(by_batch.items())),
            "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
            "decode_s_bound": round(decode_s, 2), "prefill_s_at_prefill_gflops": round(pre_s, 2),
            "prefill_s_at_peak": round(pre_peak_s, 2),
            "bound_tok_s": round(bound, 2),
            "bound_tok_s_prefill_at_peak": round(out_tokens / (decode_s + pre_peak_s), 2),
            "peers_fraction_of_bound": {k: round(v / bound, 3) for k, v in peers.items()}}


def run(rows, shapes, types, repeats: int, min_s: float, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    res = []
    for tname in types:
        t = {"BF16": BF16, "F16": F16}[tname]
        for sname in shapes:
            n, k = SHAPES[sname]
            w = _weight(t, n, k, 0)
            for m in rows:
                x = torch.randn(m, k)
                out = torch.empty(m, n)
                vs = variants(t, w, k, x, out, torch_too=m > 32)
                times = {name: [] for name in vs}
                for _ in range(repeats):
                    for name, fn in vs.items():
                        times[name].append(_time(fn, min_s))
                kernels.set_activations("float")
                med = {name: statistics.median(ts) for name, ts in times.items()}
                row = {"type": tname, "shape": sname, "n": n, "k": k, "rows": m,
                       "threads": threads, "median_s": med}
                if m <= 32:
                    row["GB_s"] = {name: 2 * n * k / s / 1e9 for name, s in med.items()}
                row["GFLOP_s"] = {name: 2 * m * n * k / s / 1e9 for name, s in med.items()}
                base, other = next(iter(med)), list(med)[1]
                row[f"{base}_over_{other}"] = med[base] / med[other]
                if "torch" in med:
                    row["torch_over_new"] = med["torch"] / med["new"]
                res.append(row)
                unit = "GB_s" if m <= 32 else "GFLOP_s"
                print(f"{tname} {sname:8s} m={m:4d} " + " ".join(
                    f"{name}={row[unit][name]:.1f}" for name in med) +
                    f" {unit}  old/new={row['old_over_new']:.2f}"
                    + (f" torch/new={row['torch_over_new']:.2f}" if "torch" in med else ""),
                    flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32, 128, 512])
    ap.add_argument("--shapes", nargs="+", default=["qo", "gate_up", "down"], choices=list(SHAPES),
                    help="gate: one of the 1.7B's gate / up segments (what a GGUF's step multiplies)")
    ap.add_argument("--types", nargs="+", default=["BF16", "F16"], choices=["BF16", "F16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-s", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="rows 1 8 128, qo and down, BF16, 3 repeats")
    ap.add_argument("--out", default="benchmarks/results/bf16-kernels.json")
    ap.add_argument("--e2e", metavar="MODEL", help="end-to-end float vs auto decode A/B instead")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--mix-split", action="store_true",
                    help="with --e2e: time `mix`'s engine steps, prefill vs decode (--batch slots)")
    ap.add_argument("--mix-bound", metavar="PROFILE_JSON",
                    help="the bandwidth bound of mix at --batch slots from a profile_decode.py "
                         "--bandwidth JSON (no model run)")
    ap.add_argument("--peak-gflops", type=float, default=960.0,
                    help="vdpbf16ps peak of the machine, both cores (measured: 2 x 480 here)")
    ap.add_argument("--prefill-gflops", type=float, default=500.0,
                    help="what the prefill GEMM reaches on both cores")
    ap.add_argument("--peer", nargs="*", default=[], metavar="NAME=TOK_S",
                    help="mix tok/s figures to show as fractions of the bound")
    a = ap.parse_args()
    if a.mix_bound:
        peers = {k: float(v) for k, v in (p.split("=", 1) for p in a.peer)}
        res = mix_bound(a.mix_bound, a.batch, a.peak_gflops, a.prefill_gflops, peers)
        print(json.dumps(res, indent=1))
        Path(a.out).write_text(json.dumps(res, indent=1))
        return
    if a.e2e and a.mix_split:
        res = mix_split(a.e2e, a.batch, a.threads)
        print(json.dumps(res))
        Path(a.out).write_text(json.dumps(res, indent=1))
        return
    if a.e2e:
        import sys
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_int8 import decode_ab
        res = decode_ab(a.e2e, a.batch, a.steps, a.repeats, a.threads)
        with open("/proc/self/status") as f:          # peak: the LLM is gone by now
            res["peak_rss_gb"] = [round(int(line.split()[1]) / 2 ** 20, 3) for line in f
                                  if line.startswith("VmHWM")][0]
        res["file_gb"] = round(sum(p.stat().st_size for p in Path(a.e2e).expanduser().glob(
            "*.safetensors")) / 2 ** 30, 3) if Path(a.e2e).expanduser().is_dir() else \
            round(Path(a.e2e).expanduser().stat().st_size / 2 ** 30, 3)
        print(json.dumps({k: v for k, v in res.items() if k != "raw"}))
        Path(a.out).write_text(json.dumps(res, indent=1))
        return
    if not kernels.available() or kernels.bf16_isa() != "avx512bf16":
        raise SystemExit(f"needs the native kernels on an avx512bf16 CPU ({kernels.unavailable})")
    if a.quick:
        a.rows, a.shapes, a.types, a.repeats = [1, 8, 128], ["qo", "down"], ["BF16"], 3
    res = run(a.rows, a.shapes, a.types, a.repeats, a.min_s, a.threads)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "features": sorted(kernels.features()),
        "note": "same process, alternating, medians; loaded shared 2-core machine",
        "results": res}, indent=1))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
