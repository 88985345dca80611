"""What constrained sampling costs, and that unconstrained steps pay nothing for it.

Same process, interleaved, on the tiny random model of tests/fixtures:

1. the sampler's all-greedy fast path, 8 unconstrained rows: the sampler of a git ref
   (`--ref`, default main's merge base 79e41bd, loaded as a separate module) against this
   tree's, alternating blocks of calls;
2. one engine step with 8 unconstrained greedy decode rows, the runner's sampler swapped
   between the two every 20 steps (same engine, same KV cache);
3. one engine step with 8 decode rows all constrained to a small JSON schema vs 8
   unconstrained ones (two engines, steps interleaved).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_constrained_overhead.py [--ref REV]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "tags": {"type": "array",
                                                          "items": {"type": "string"}}},
          "required": ["name", "tags"]}


def load_old_sampler(ref: str):
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:src/iterserve/model/sampler.py"],
                         check=True, capture_output=True, text=True).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / "old_sampler.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_sampler", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="79e41bd")
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()

    import torch

    from iterserve.core.request import SamplingParams
    from iterserve.engine.args import EngineArgs
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.model import sampler as new
    from iterserve.structured import StructuredOutputsParams
    old = load_old_sampler(args.ref)
    torch.set_num_threads(1)

    class Row:
        def __init__(self, p):
            self.sampling_params, self.prompt_token_ids, self.output_token_ids = p, [1, 2], [3]

    for vocab in (512, 49152):
        rows = [Row(SamplingParams(temperature=0.0)) for _ in range(8)]
        logits = torch.randn(8, vocab)
        a, b = old.Sampler(seed=0), new.Sampler(seed=0)
        ta, tb = [], []
        for rep in range(30):
            for f, acc in (((a, ta), (b, tb)) if rep % 2 else ((b, tb), (a, ta))):
                t = time.perf_counter()
                for _ in range(200):
                    f(logits, rows)
                acc.append((time.perf_counter() - t) / 200 * 1e6)
        print(f"sampler fast path, 8 greedy rows, vocab {vocab}: {args.ref} "
              f"{statistics.median(ta):.2f} us, this tree {statistics.median(tb):.2f} us")

    from fixtures.tiny_models import make_tiny_model_dir
    d = make_tiny_model_dir(pathlib.Path(tempfile.mkdtemp()))

    def engine(constrained: bool) -> LLMEngine:
        e = LLMEngine.from_engine_args(EngineArgs(model=str(d), num_kv_blocks=512,
                                                  max_model_len=1024))
        so = StructuredOutputsParams(json=SCHEMA) if constrained else None
        for i in range(8):
            e.add_request(f"r{i}", f"Request {i} says hello", SamplingParams(
                max_tokens=1000, temperature=0.0, ignore_eos=True, structured_outputs=so))
        for _ in range(5):
            e.step()
        return e

    e = engine(False)
    samplers = {args.ref: old.Sampler(seed=0), "this tree": new.Sampler(seed=0)}
    times: dict[str, list[float]] = {k: [] for k in samplers}
    for block in range(args.steps // 20):
        name = list(samplers)[block % 2]
        e.executor.sampler = samplers[name]
        for _ in range(20):
            t = time.perf_counter()
            e.step()
            times[name].append((time.perf_counter() - t) * 1e6)
    for k, v in times.items():
        print(f"engine step, 8 unconstrained decode rows, sampler of {k}: "
              f"median {statistics.median(v):.0f} us over {len(v)} steps")

    free, json_e = engine(False), engine(True)
    tf, tc = [], []
    for i in range(args.steps):
        for eng, acc in ((free, tf), (json_e, tc)) if i % 2 else ((json_e, tc), (free, tf)):
            if not eng.has_unfinished_requests():
                continue
            t = time.perf_counter()
            eng.step()
            acc.append((time.perf_counter() - t) * 1e6)
    print(f"engine step, 8 decode rows: unconstrained median {statistics.median(tf):.0f} us "
          f"({len(tf)} steps), JSON-schema constrained median {statistics.median(tc):.0f} us "
          f"({len(tc)} steps)")


if __name__ == "__main__":
    main()
