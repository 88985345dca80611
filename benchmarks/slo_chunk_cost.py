"""Where chunked prefill's throughput cost comes from, on the model runner.

Why: on `longprompt-heavy` a 128-token budget lowers p99 ITL 6x but costs 6-8% of the
throughput, budget 512 costs 4.3% for 2.4x. This times, on the bundled model's ModelRunner
(the engine's own forward path, no server), the step shapes a chunked and an unchunked run
are made of, so the cost can be split into its parts:

- `chunk`: a prefill chunk of C tokens (128 / 192 / 256 / 384 / 512) at context S (0, 512,
  1024, 1536) alone, its time per token against a whole 2000-token prefill's per token (the
  GEMM rows' efficiency and the attention at context);
- `mixed`: the same chunk next to 16 running decodes (@256): mixed - chunk alone is what
  the decodes cost inside a mixed step, against a decode-only step (which runs all layers in
  one native call, kernels/decode_layers.c, while a mixed step runs them per module);
- `plan`: one 2000-token prompt chunked at budget B with 16 decodes (what the scheduler
  builds: chunk = B - 16 each step) against the whole prompt in one step plus decode-only
  steps for the same decode tokens: the extra seconds per long prompt.

Alternating order within each repeat, medians of `--repeats` (under load only same-run
ratios mean anything).

    PYTHONPATH=src python benchmarks/slo_chunk_cost.py [--repeats 5] [--budgets 128,256,512]
        [--out benchmarks/results/slo-chunk-cost.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

BS = 16
DEC_CTX = 256


class Shapes:
    """SchedulerOutputs of given (start, num_tokens) spans on one runner, fresh ids each."""

    def __init__(self, decodes: int, prompt: int) -> None:
        self.rng = random.Random(0)
        self.decodes = decodes
        self.prompt = prompt
        self.dec_blocks = -(-(DEC_CTX + 1) // BS)
        self.long_blocks = -(-prompt // BS)
        self.num_blocks = decodes * self.dec_blocks + self.long_blocks
        self.dec_tokens = [[self.rng.randrange(3, 1000) for _ in range(DEC_CTX + 1)]
                           for _ in range(decodes)]
        self.long_tokens = [self.rng.randrange(3, 1000) for _ in range(prompt)]
        self.seq = 0

    def step(self, chunk: tuple[int, int] | None, decodes: int | None = None):
        from iterserve.core.request import SamplingParams
        from iterserve.core.scheduler_output import NewRequestData, SchedulerOutput

        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        self.seq += 1
        new, num = [], {}
        for j in range(self.decodes if decodes is None else decodes):
            rid = f"d{self.seq}-{j}"
            new.append(NewRequestData(rid, self.dec_tokens[j], params, tuple(
                range(j * self.dec_blocks, (j + 1) * self.dec_blocks)), DEC_CTX))
            num[rid] = 1
        if chunk is not None:
            start, n = chunk
            rid = f"L{self.seq}"
            new.append(NewRequestData(rid, self.long_tokens[:start + n], params, tuple(
                range(self.decodes * self.dec_blocks, self.num_blocks)), start))
            num[rid] = n
        return SchedulerOutput(step=self.seq, scheduled_new_reqs=new, num_scheduled_tokens=num,
                               num_batched_tokens=sum(num.values()))


def plan_chunks(prompt: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(chunk, prompt - s)) for s in range(0, prompt, chunk)]


def measure(repeats: int, chunks: list[int], contexts: list[int], budgets: list[int],
            decodes: int, prompt: int) -> dict[str, Any]:
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner

    sh = Shapes(decodes, prompt)
    # name -> list of SchedulerOutputs run back to back (one sample = their total)
    plans: dict[str, list] = {"decode step": [sh.step(None)],
                              f"whole {prompt}": [sh.step((0, prompt), 0)],
                              f"whole {prompt} + decodes": [sh.step((0, prompt))]}
    for c in chunks:
        for s in contexts:
            if s + c <= prompt:
                plans[f"chunk {c} @{s}"] = [sh.step((s, c), 0)]
                plans[f"chunk {c} @{s} + decodes"] = [sh.step((s, c))]
    for b in budgets:
        plans[f"plan budget {b}"] = [sh.step(x) for x in plan_chunks(prompt, b - decodes)]
    runner = ModelRunner(load_model(None), num_blocks=sh.num_blocks, block_size=BS)
    for outs in plans.values():                 # warm-up (and the pool holds the prompt's K/V)
        for o in outs:
            runner.execute(o)
    times: dict[str, list[float]] = {k: [] for k in plans}
    names = list(plans)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            for o in plans[name]:
                runner.execute(o)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    dec = med["decode step"]
    whole = med[f"whole {prompt}"]
    rows = []
    for c in chunks:
        for s in contexts:
            k = f"chunk {c} @{s}"
            if k not in med:
                continue
            alone, mixed = med[k], med[k + " + decodes"]
            # per token against the whole prompt's average token (whose attention runs over
            # half the prompt on average: a chunk at context > ~1000 pays more per token)
            rows.append({"chunk": c, "context": s, "alone_s": alone, "mixed_s": mixed,
                         "per_token_vs_whole": (alone / c) / (whole / prompt),
                         "decodes_in_mixed_s": mixed - alone,
                         "decodes_in_mixed_vs_decode_step": (mixed - alone) / dec})
            print(f"  chunk {c:4d} @{s:5d}: alone {alone * 1e3:7.1f} ms "
                  f"({rows[-1]['per_token_vs_whole']:.2f}x whole's per token), + {decodes} "
                  f"decodes {mixed * 1e3:7.1f} ms (decodes inside {(mixed - alone) * 1e3:5.1f} "
                  f"ms = {rows[-1]['decodes_in_mixed_vs_decode_step']:.2f}x a decode step)",
                  flush=True)
    plan_rows = []
    for b in budgets:
        n = len(plans[f"plan budget {b}"])
        base = med[f"whole {prompt} + decodes"] + (n - 1) * dec
        ch = med[f"plan budget {b}"]
        plan_rows.append({"budget": b, "chunks": n, "chunked_s": ch, "unchunked_s": base,
                          "extra_s": ch - base, "extra_frac": (ch - base) / base})
        print(f"  plan budget {b:4d}: {n:3d} chunk steps {ch:.3f} s vs whole + "
              f"{n - 1} decode steps {base:.3f} s: +{ch - base:.3f} s "
              f"({(ch - base) / base:+.1%}) per {prompt}-token prompt", flush=True)
    print(f"  decode step ({decodes} @{DEC_CTX}) {dec * 1e3:.1f} ms; whole {prompt} "
          f"{whole * 1e3:.1f} ms ({whole / prompt * 1e3:.3f} ms/token); whole + decodes "
          f"{med[f'whole {prompt} + decodes'] * 1e3:.1f} ms", flush=True)
    return {"decodes": decodes, "decode_context": DEC_CTX, "prompt": prompt,
            "repeats": repeats, "median_s": med, "chunks": rows, "plans": plan_rows,
            "decode_step_s": dec, "whole_prompt_s": whole}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", default="112,128,176,192,240,256,368,384,496,512")
    ap.add_argument("--contexts", default="0,512,1024,1536")
    ap.add_argument("--budgets", default="128,192,256,384,512")
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--out", default="benchmarks/results/slo-chunk-cost.json")
    a = ap.parse_args(argv)
    from iterserve.bench.client import machine_info

    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    t0 = time.time()
    res = measure(a.repeats, [int(x) for x in a.chunks.split(",")],
                  [int(x) for x in a.contexts.split(",")],
                  [int(x) for x in a.budgets.split(",")], a.decodes, a.prompt)
    doc = {"benchmark": "slo_chunk_cost", "machine": machine_info(), "loadavg_before": load,
           "wall_s": time.time() - t0, **res}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
