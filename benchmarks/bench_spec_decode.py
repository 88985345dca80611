"""What speculative decoding gains on the `edit` workload (or `--workload mix`, chat answers
that do not repeat the prompt): the bundled model (or `--model`) at batch 1, one engine with
`--speculative-config` and one without, in the same process, same run. With a
`draft_model` config this is the draft model's measure: e.g. the bundled Q4_1 drafting for
an F16 file of the same weights.

Each request of `edit` (a Python file quoted back with one function renamed) goes to both
engines in turn, the order swapped every request so drift on a shared machine hits both alike.
Greedy, ignore_eos, max_tokens the file's length (or --max-tokens): both engines generate the
same number of tokens, and the tokens themselves must be equal (speculation keeps greedy
output). Reported per arm: output tok/s (tokens / wall time of the request, TTFT included) and
the mean time per output token after the first (the inter-token latency a client sees,
averaged over a request's stream); the ratio is speculation on / off, with the median over
requests.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_spec_decode.py \
        [--spec '{"method": "ngram", "num_speculative_tokens": 4}'] [--num-requests 4] \
        [--max-tokens N] [--model PATH] [--out benchmarks/results/spec-decode-edit.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def timed_chat(llm, prompt: str, max_tokens: int) -> dict:
    """One request, streamed through the engine step by step: TTFT and per-token times."""
    from iterserve.core.request import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.chat([{"role": "user", "content": prompt}], sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    ids = list(out.outputs[0].token_ids)
    return {"tokens": ids, "wall_s": wall, "tok_per_s": len(ids) / wall}


def first_token_s(llm, prompt: str) -> float:
    """TTFT of the prompt (a one-token request), to take prefill out of the per-token time."""
    from iterserve.core.request import SamplingParams
    t0 = time.perf_counter()
    llm.chat([{"role": "user", "content": prompt}],
             SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4}')
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    ap.add_argument("--num-requests", type=int, default=4)
    ap.add_argument("--workload", default="edit",
                    help="edit (answers that repeat the prompt) or mix (chat answers that "
                         "do not)")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap each request's answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from iterserve.bench.client import machine_info
    from iterserve.bench.workloads import build_workload
    from iterserve.engine.llm import LLM

    spec = json.loads(args.spec)
    w = build_workload(args.workload, seed=args.seed, num_requests=args.num_requests)
    arms = {"off": LLM(model=args.model, max_num_seqs=1),
            "on": LLM(model=args.model, max_num_seqs=1, speculative_config=spec)}
    for llm in arms.values():                                   # warm-up outside the timing
        timed_chat(llm, w.requests[0].prompt, 4)
    rows = []
    for i, r in enumerate(w.requests):
        n = r.max_tokens if args.max_tokens is None else min(args.max_tokens, r.max_tokens)
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        res = {}
        for name in order:
            ttft = first_token_s(arms[name], r.prompt)
            res[name] = timed_chat(arms[name], r.prompt, n)
            res[name]["ttft_s"] = ttft
            res[name]["itl_ms"] = 1000 * (res[name]["wall_s"] - ttft) / max(1, n - 1)
        same = res["on"]["tokens"] == res["off"]["tokens"]
        row = {"index": r.index, "order": list(order), "max_tokens": n, "greedy_equal": same,
               "ratio": res["on"]["tok_per_s"] / res["off"]["tok_per_s"],
               **{k: {f: v[f] for f in ("wall_s", "tok_per_s", "ttft_s", "itl_ms")}
                  for k, v in res.items()}}
        rows.append(row)
        print(f"request {i}: off {row['off']['tok_per_s']:.2f} tok/s "
              f"(ITL {row['off']['itl_ms']:.1f} ms), on {row['on']['tok_per_s']:.2f} tok/s "
              f"(ITL {row['on']['itl_ms']:.1f} ms), ratio {row['ratio']:.2f}, "
              f"greedy equal {same}", flush=True)
    doc = {"benchmark": f"spec-decode-{args.workload}", "speculative_config": spec,
           "model": args.model or "bundled",
           "workload": w.summary(), "machine": machine_info(), "requests": rows,
           "median_ratio": statistics.median(x["ratio"] for x in rows),
           "median_itl_ms": {a: statistics.median(x[a]["itl_ms"] for x in rows)
                             for a in ("off", "on")}}
    print(f"median tok/s ratio (on/off): {doc['median_ratio']:.2f}; median ITL off "
          f"{doc['median_itl_ms']['off']:.1f} ms, on {doc['median_itl_ms']['on']:.1f} ms",
          flush=True)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
