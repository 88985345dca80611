"""Decode throughput: iterserve's ModelRunner vs HF transformers `generate` vs a plain GEMM.

For each batch size B, B requests with ctx-token prompts are prefilled (not timed), then
`--steps` decode steps are timed: output tokens/s = B * steps / seconds.

- iterserve: ModelRunner.execute on hand-made scheduler steps (paged KV cache, greedy).
- HF: `generate(do_sample=False)` on the same GGUF loaded by transformers (dequantized to
  fp32); a logits processor timestamps each step, so prefill is excluded the same way.
- GEMM: only the matrix multiplies one decode step needs (q/k/v, o, gate/up, down per layer
  and the lm_head), each a plain torch.mm over its own weight: a ceiling to compare
  iterserve's decode with (half of it at batch 32 is the bar).

    .venv/bin/python benchmarks/bench_decode.py [--batch-sizes 1,8,32,64] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from iterserve.core.request import Request, SamplingParams
from iterserve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


def prompts(batch: int, ctx: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, vocab - 100, (batch, ctx), generator=g).tolist()


def greedy(logits, requests):
    from iterserve.core.scheduler_output import SampleResult
    return [SampleResult(int(t)) for t in logits.argmax(-1).tolist()]


def bench_iterserve(loaded, batch: int, ctx: int, steps: int, block_size: int = 16,
                    packed: str | None = "default", quant: bool | str = "default") -> float:
    from iterserve.model.runner import ModelRunner
    per_req = (ctx + steps + 2 + block_size - 1) // block_size
    runner = ModelRunner(loaded, num_blocks=batch * per_req, block_size=block_size,
                         sampler=greedy, pack_weights=packed, quant_kernels=quant)
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=steps + 2))
            for i, p in enumerate(prompts(batch, ctx, loaded.config.vocab_size))]
    tables = {r.request_id: list(range(i * per_req, (i + 1) * per_req)) for i, r in enumerate(reqs)}

    sent: set[str] = set()

    def one_step(n: int, chunk_reqs: list[Request]) -> None:
        # New requests once, then per-step diffs (the runner appends what it samples).
        out = SchedulerOutput(step=n)
        for r in chunk_reqs:
            rid = r.request_id
            if rid in sent:
                out.scheduled_cached_reqs.append(CachedRequestData(rid, (), r.num_computed_tokens))
            else:
                out.scheduled_new_reqs.append(NewRequestData(
                    rid, r.prompt_token_ids, r.sampling_params, tuple(tables[rid]),
                    r.num_computed_tokens))
                sent.add(rid)
            out.num_scheduled_tokens[rid] = r.num_tokens - r.num_computed_tokens
        res = runner.execute(out)
        for r in chunk_reqs:
            r.num_computed_tokens = r.num_tokens
            r.append_output_token(res[r.request_id].token_id, 0.0)

    for i in range(0, batch, 4):           # prefill a few prompts per step (not timed)
        one_step(0, reqs[i:i + 4])
    one_step(1, reqs)                      # warm-up decode
    t = time.perf_counter()
    for s in range(steps):
        one_step(2 + s, reqs)
    return batch * steps / (time.perf_counter() - t)


def bench_hf(hf_model, batch: int, ctx: int, steps: int, vocab: int) -> float:
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    stamp = Stamp()
    ids = torch.tensor(prompts(batch, ctx, vocab))
    with torch.inference_mode():
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 2,
                          min_new_tokens=steps + 2, do_sample=False, pad_token_id=0,
                          logits_processor=LogitsProcessorList([stamp]))
    # times[0] follows the prefill; the next `steps + 1` intervals are decode steps.
    n = len(stamp.times) - 1
    return batch * n / (stamp.times[-1] - stamp.times[0])


def bench_gemm(config, batch: int, steps: int) -> float:
    h, i, q, kv = config.hidden_size, config.intermediate_size, \
        config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)] * config.num_layers + [(h, config.vocab_size)]
    weights = [torch.randn(n, k) * 0.02 for k, n in shapes]
    xs = {k: torch.randn(batch, k) for k, _ in shapes}

    def one() -> None:
        for (k, _), w in zip(shapes, weights):
            torch.mm(xs[k], w.t())

    one()                                   # warm-up; then timed like the decode loops:
    t = time.perf_counter()                 # the mean over `steps`, not a best case
    for _ in range(steps):
        one()
    return batch * steps / (time.perf_counter() - t)


def load_hf_gguf(path: str):
    from transformers import AutoModelForCausalLM
    p = Path(path)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                dtype=torch.float32).eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2)")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--ctx", type=int, default=200, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    ap.add_argument("--variants", default="float,plain",
                    help="extra iterserve runs with other weight packings (plain = F.linear, "
                         "mkl, onednn; see layers.Linear); '' for none")
    ap.add_argument("--out", default=None, help="write the JSON results here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from iterserve.model.loader import load_model
    if args.model is None:
        from iterserve.model.default_model import default_model_path
        args.model = default_model_path()
    loaded = load_model(args.model)
    hf_model = None if args.no_hf else load_hf_gguf(args.model)
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        # iterserve as it runs by default (runner.PACKING_DEFAULT), then the other packings.
        row = {"batch": b,
               "iterserve_tok_s": bench_iterserve(loaded, b, args.ctx, args.steps),
               "gemm_tok_s": bench_gemm(loaded.config, b, args.steps)}
        for v in filter(None, args.variants.split(",")):
            # "float": the default packing without the quantised kernel; "plain"/"mkl":
            # that packing (None = F.linear), also on the float weights.
            packed = "default" if v == "float" else None if v == "plain" else v
            row[f"iterserve_{v}_tok_s"] = bench_iterserve(
                loaded, b, args.ctx, args.steps, packed=packed, quant=False)
        loaded.model.pack_linears(None)         # free the packed copies
        if hf_model is not None:
            row["hf_tok_s"] = bench_hf(hf_model, b, args.ctx, args.steps, loaded.config.vocab_size)
            row["vs_hf"] = row["iterserve_tok_s"] / row["hf_tok_s"]
        row["vs_gemm"] = row["iterserve_tok_s"] / row["gemm_tok_s"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    result = {"model": args.model, "ctx": args.ctx, "steps": args.steps, "threads": args.threads,
              "torch": torch.__version__, "results": rows}
    nan = float("nan")
    variants = [v for v in args.variants.split(",") if v]
    print(f"\n{'batch':>5} {'iterserve':>10} " + "".join(f"{v:>8} " for v in variants)
          + f"{'HF':>8} {'GEMM':>8} {'vs HF':>6} {'vs GEMM':>7}   (output tok/s)")
    for r in rows:
        print(f"{r['batch']:>5} {r['iterserve_tok_s']:>10.1f} "
              + "".join(f"{r[f'iterserve_{v}_tok_s']:>8.1f} " for v in variants)
              + f"{r.get('hf_tok_s', nan):>8.1f} {r['gemm_tok_s']:>8.1f} {r.get('vs_hf', nan):>6.2f} "
              f"{r['vs_gemm']:>7.2f}")
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
