"""Tensor parallel 1 vs 2 on this machine: correctness and overhead, not speed-up.

This machine has 2 cores: TP = 2 runs two ranks of one thread each, TP = 1 one process of two
threads, so the same cores do the same FLOPs either way and what TP adds shows directly: the
per-step broadcast of the SchedulerOutput, two all-reduces per layer, the embedding's
all-reduce and the logits gather, and the per-op decode path (the fused decode layers are
off under TP). A real speed-up needs ranks on separate cores or GPUs with their own memory
bandwidth.

Model: a random-weight Llama-shaped GGUF, Q4_0 in every matrix (hidden 1024, 16 heads, 8 KV
heads, 8 layers, FFN 2816, vocabulary 16384: ~60 MB; the bundled SmolLM2-135M has 3 KV heads,
which do not split over 2 ranks). Both engines live in one process and the runs alternate
(TP 1, TP 2, TP 1, ...), several repeats, medians: the machine is shared, single runs are
noise. torch's thread count is set per run: TP 1 runs twice, with all cores and with one
thread (what each TP 2 rank has), and rank 0 of TP 2 runs with one.

    PYTHONPATH=src python benchmarks/bench_tp.py [--repeats 3] [--out benchmarks/results/tp-bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CFG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
           num_attention_heads=16, num_key_value_heads=8, vocab_size=16384,
           rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
           tie_word_embeddings=True)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, CFG["vocab_size"] - 100, (n, length), generator=g).tolist()


def _run(llm, threads: int, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    from iterserve.core.request import SamplingParams
    torch.set_num_threads(threads)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def _broadcast_us(tp, steps: int = 300) -> float:
    """Per-step cost of sending a SchedulerOutput to the other rank (an empty step: nothing
    is computed, the next broadcast waits for the previous one)."""
    from iterserve.core.scheduler_output import SchedulerOutput
    ex = tp.engine.executor
    t0 = time.perf_counter()
    for i in range(steps):
        ex.compute_logits(SchedulerOutput(step=10_000 + i))
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/tp-bench.json"))
    ap.add_argument("--model", default=None, help="a GGUF to use instead of the random one")
    args = ap.parse_args()

    from fixtures.tiny_gguf import write_random_llama_gguf
    from iterserve import LLM

    model = args.model
    if model is None:
        model = "/tmp/iterserve-bench-tp.gguf"
        if not os.path.exists(model):
            write_random_llama_gguf(model, CFG, "Q4_0", seed=0, name="bench tp")
    cores = len(os.sched_getaffinity(0))
    kw = dict(num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=512)
    torch.set_num_threads(cores)
    tp1 = LLM(model, **kw)
    t0 = time.perf_counter()
    tp2 = LLM(model, tensor_parallel_size=2, **kw)
    startup = time.perf_counter() - t0
    scenarios = {
        "decode_b1": (_prompts(1, 32, 1), 64),
        "decode_b8": (_prompts(8, 32, 2), 32),
        "prefill_512": (_prompts(1, 512, 3), 1),
    }
    results: dict = {}
    try:
        for name, (prompts, max_tokens) in scenarios.items():
            _run(tp1, cores, prompts, 2)           # warm both (kernel builds, first tables)
            _run(tp2, 1, prompts, 2)
            times = {1: [], "1_1thread": [], 2: []}
            tokens = {}
            for _ in range(args.repeats):
                for size, llm, threads in ((1, tp1, cores), ("1_1thread", tp1, 1), (2, tp2, 1)):
                    dt, toks = _run(llm, threads, prompts, max_tokens)
                    times[size].append(dt)
                    tokens[size] = toks
            n_out = len(prompts) * max_tokens
            n_in = sum(len(p) for p in prompts)
            rec = {"prompts": len(prompts), "prompt_tokens": n_in, "max_tokens": max_tokens,
                   "identical_greedy_outputs": tokens[1] == tokens[2]}
            for size in (1, "1_1thread", 2):
                med = statistics.median(times[size])
                rec[f"tp{size}"] = {"seconds": [round(t, 4) for t in times[size]],
                                    "median_s": round(med, 4),
                                    "output_tok_s": round(n_out / med, 1),
                                    "total_tok_s": round((n_in + n_out) / med, 1)}
            rec["tp2_over_tp1_time"] = round(rec["tp2"]["median_s"] / rec["tp1"]["median_s"], 3)
            rec["tp2_over_tp1_1thread_time"] = round(
                rec["tp2"]["median_s"] / rec["tp1_1thread"]["median_s"], 3)
            results[name] = rec
            print(name, json.dumps(rec), flush=True)
        torch.set_num_threads(1)
        bcast = statistics.median(_broadcast_us(tp2) for _ in range(3))
    finally:
        tp2.engine.shutdown()
    report = {
        "what": "TP 1 vs TP 2 on this machine, same process, runs alternated, medians",
        "machine": {"cores": cores, "loadavg_at_end": os.getloadavg()},
        "model": {"path": model, **({} if args.model else {"config": CFG, "type": "Q4_0"})},
        "engine_args": kw, "repeats": args.repeats,
        "tp2_startup_s": round(startup, 2),
        "broadcast_per_step_us": round(bcast, 1),
        "scenarios": results,
        "note": "2 cores: TP 2 splits the same cores, so the ratio measures TP's overhead "
                "(collectives, per-op decode path), not a speed-up. Taken under load from "
                "other work sharing the machine.",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
