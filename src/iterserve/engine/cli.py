"""`iterserve generate`: offline generation from the command line (the LLM API, no server).

    iterserve generate "Once upon a time" "The capital of France is" --max-tokens 32
    iterserve generate --chat "Write a haiku about caches" --temperature 0.7
    echo "prompt per line" | iterserve generate -

Prints each completion (or JSON lines with --json) and, at the end, throughput and the
per-request latency metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(subparsers: argparse._SubParsersAction) -> None:
    from iterserve.engine.args import EngineArgs

    p = subparsers.add_parser("generate", help="generate offline for prompts given as arguments",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts", nargs="*", help="prompts; '-' reads one prompt per stdin line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iterserve.core.config import ConfigError
    from iterserve.core.request import SamplingParams
    from iterserve.engine.args import EngineArgs
    from iterserve.engine.llm import LLM

    prompts: list[str] = []
    for p in args.prompts:
        if p == "-":
            prompts.extend(line.rstrip("\n") for line in sys.stdin if line.strip())
        else:
            prompts.append(p)
    if not prompts:
        print("iterserve generate: give at least one prompt (or '-' for stdin)", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, n=args.n, stop=args.stop,
                            seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    try:
        params.validate()
        ea = EngineArgs.from_cli_args(args)
        llm = LLM(**{k: v for k, v in vars(ea).items()})
        t0 = time.perf_counter()
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                            use_tqdm=not args.no_progress)
        else:
            outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
        elapsed = time.perf_counter() - t0
    except (ConfigError, ValueError) as e:
        print(f"iterserve generate: {e}", file=sys.stderr)
        return 2
    total = 0
    for prompt, out in zip(prompts, outs):
        for co in out.outputs:
            total += len(co.token_ids)
            if args.json:
                print(json.dumps({"prompt": prompt, "index": co.index, "text": co.text,
                                  "token_ids": co.token_ids, "finish_reason": co.finish_reason,
                                  "metrics": co.metrics.to_dict() if co.metrics else None}))
            else:
                print(f"--- {prompt!r} [{co.index}] ({co.finish_reason}, "
                      f"{len(co.token_ids)} tokens)")
                print(co.text)
    print(f"{len(outs)} requests, {total} tokens in {elapsed:.2f} s "
          f"({total / elapsed if elapsed else 0:.1f} tok/s)", file=sys.stderr)
    return 0
