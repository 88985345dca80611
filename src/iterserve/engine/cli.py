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

from iterserve.core.config import GenerateConfig, add_config_arguments, knob_notices
from iterserve.core.request import SamplingParams
from iterserve.engine.args import EngineArgs
from iterserve.engine.llm import LLM
from iterserve.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    """`iterserve generate`: its own flags (GenerateConfig) and EngineArgs's, all from the
    knob schema (core/config.py)."""
    p = subparsers.add_parser("generate", help="generate offline for prompts given as arguments",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts", nargs="*", help="prompts; '-' reads one prompt per stdin line")
    add_config_arguments(p, (GenerateConfig,))
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
                            top_p=args.top_p, top_k=args.top_k, n=args.n, stop=args.stop or [],
                            seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    try:
        params.validate()
        ea = EngineArgs.from_cli_args(args)
        for line in knob_notices(ea):
            print(f"iterserve generate: {line}", file=sys.stderr)
        llm = LLM(**{k: v for k, v in vars(ea).items()})
        t0 = time.perf_counter()
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                            use_tqdm=args.progress)
        else:
            outs = llm.generate(prompts, params, use_tqdm=args.progress)
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
