"""The served step loop's own cost: how long the engine thread waits between two steps.

Why: `profile_decode.py` times a step inside the engine; a served token also pays the async
loop (engine/async_engine.py: the step's future resolving on the event loop, outputs handed
to the streams, the next step submitted) and the streaming responses' Python, which run
while the engine thread idles. This runs a real `iterserve serve` in this process with the
engine's `_step` wrapped (start / end times), sends batch-1 and then `--batch` concurrent
streaming requests with the same client as run_models.py, and reports per phase the median
step time and the median gap (next step's start minus this step's end), so gap / (step +
gap) is the share of a served decode the loop costs. Same process, alternating: the loop
pipelined (`AsyncEngine.pipeline_steps = True`: the next step submitted before the outputs
go out; opt-in, an abort then lands one step later) and serial (the default), `--repeats`
times each.

    python benchmarks/step_gap.py --model FILE.gguf [--batch 8] [--tokens 48] [--port 18260]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--port", type=int, default=18260)
    ap.add_argument("--repeats", type=int, default=3,
                    help="alternating pipelined / serial loop runs per batch size")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra serve flags")
    args = ap.parse_args(argv)

    from iterserve.engine import async_engine
    spans: list[tuple[float, float, int]] = []
    inner = async_engine.AsyncEngine._step

    def timed_step(self):
        t = time.perf_counter()
        out = inner(self)
        spans.append((t, time.perf_counter(), len(out)))
        return out
    async_engine.AsyncEngine._step = timed_step

    doc: dict = {"kind": "step-gap", "model": args.model or "bundled", "batch": args.batch,
                 "tokens": args.tokens}

    def client() -> None:
        import httpx
        from run_models import _one_request_workload, _run
        url = f"http://127.0.0.1:{args.port}"
        try:
            for _ in range(1200):
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            _run(url, _one_request_workload(16, 8, 1))                 # warm-up
            runs = [(f"{name}-{mode}", n, mode) for _ in range(args.repeats)
                    for mode in ("pipelined", "serial")
                    for name, n in (("b1", 1), (f"b{args.batch}", args.batch))]
            for phase, n, mode in runs:
                async_engine.AsyncEngine.pipeline_steps = mode == "pipelined"
                w = _one_request_workload(16, args.tokens, 2)
                w = type(w)(name=w.name, seed=w.seed, rate=None,
                            requests=tuple(type(w.requests[0])(
                                index=i, prompt=w.requests[0].prompt, prompt_len=16,
                                max_tokens=args.tokens, arrival_s=0.0, kind="short")
                                for i in range(n)),
                            description=f"{n} x 16 prompt, {args.tokens} out")
                lo = len(spans)
                _run(url, w)
                s = spans[lo:]
                steps = [e - b for b, e, _ in s][2:]             # past the prefill steps
                gaps = [s[i + 1][0] - s[i][1] for i in range(len(s) - 1)][2:]
                doc.setdefault("samples", {}).setdefault(phase, []).append({"steps": len(steps),
                              "step_ms_median": round(statistics.median(steps) * 1e3, 3),
                              "gap_ms_median": round(statistics.median(gaps) * 1e3, 3),
                              "gap_ms_mean": round(statistics.fmean(gaps) * 1e3, 3),
                              "ms_per_step_incl_gap": round((s[-1][1] - s[2][0]) / (len(s) - 2)
                                                            * 1e3, 3),
                              "gap_share": round(statistics.median(gaps) / (
                                  statistics.median(steps) + statistics.median(gaps)), 4)})
                print(phase, json.dumps(doc["samples"][phase][-1]), flush=True)
            doc["median"] = {ph: {k: round(statistics.median(x[k] for x in xs), 3)
                                  for k in ("step_ms_median", "gap_ms_median", "gap_share",
                                            "ms_per_step_incl_gap")}
                             for ph, xs in doc["samples"].items()}
        finally:
            doc["load_1m"] = round(os.getloadavg()[0], 2)
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=client, daemon=True).start()
    from iterserve import cli
    serve = ["serve", "--host", "127.0.0.1", "--port", str(args.port), "--log-level", "warning",
             "--max-num-seqs", str(max(args.batch, 1)), *args.serve_arg]
    if args.model:
        serve += ["--model", args.model]
    try:
        cli.main(serve)
    except (SystemExit, KeyboardInterrupt):
        pass
    print(json.dumps(doc.get("median"), indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
