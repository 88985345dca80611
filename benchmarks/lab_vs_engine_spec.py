"""Does the lab predict what speculative decoding gains on the real engine?

Speculation's gain is a ratio: tokens per second with drafts verified against the same
engine without them. It depends on the batch size (at batch 1 a verify row costs little next
to reading the weights; at 8 rows the step is no longer only that) and on how often drafts
are accepted. The lab (lab/simulator.py with `speculative_config`) prices a verification
with the cost model and draws acceptance from per-position rates; the engine here uses
`synthetic` speculation with the same rates (its runner draws acceptance the same way, so
the bundled model's real verification steps run at a chosen acceptance, whatever its
greedy tokens are). Both run the adaptive plan (core/spec_decode/adaptive.py) that turns
drafts off where they would be a loss.

For each --slots and each --acceptance a (draft j accepted with a^j), the offline engine
(`LLM.generate`, the bundled model, `mix` requests at t=0, ignore_eos) runs without
speculation and with it; the lab simulates the same requests (the engine's prompt token
counts, the same output lengths, the engine's own scheduler and KV knobs) both ways with a
cost model (default the shipped `smollm2-cpu`; `iterserve lab calibrate` fits this
machine). Reported per point: real and lab tokens/s both ways, the gain each way and the
lab's gain over the real one (target: within 15%), and the acceptance both saw.

    .venv/bin/python benchmarks/lab_vs_engine_spec.py [--slots 1,4,8] [--acceptance 0.5,0.8]
        [-k 4] [--num-requests 16] [--cost-model smollm2-cpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lab_vs_engine import _params, lab_settings, run_engine, run_lab_seconds  # noqa: E402

from iterserve.bench.client import machine_info  # noqa: E402
from iterserve.bench.workloads import build_workload  # noqa: E402
from iterserve.core.cost_model import load_cost_model  # noqa: E402
from iterserve.lab.metrics import summarize  # noqa: E402


def synthetic(k: int, a: float) -> dict:
    return {"method": "synthetic", "num_speculative_tokens": k,
            "acceptance_rates": [round(a ** (j + 1), 6) for j in range(k)]}


def one_arm(slots: int, spec: dict | None, w, cost, model: str | None, seed: int) -> dict:
    """A fresh engine with `spec` (None: off) serves `w`; the lab simulates the same."""
    from iterserve.engine.args import EngineArgs
    from iterserve.engine.llm import LLM
    from iterserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, max_num_seqs=slots, speculative_config=spec, seed=seed))
    try:
        warm = build_workload("mix", seed=seed + 1, num_requests=2)
        LLM.from_engine(engine).generate([r.prompt for r in warm.requests], _params(warm),
                                         use_tqdm=False)
        prompt_lens = [len(engine.tokenize_prompt(r.prompt)) for r in w.requests]
        sched = engine.scheduler
        before = sched.spec.total.to_dict() if sched.spec is not None else None
        real = run_engine(engine, w)
        after = sched.spec.total.to_dict() if sched.spec is not None else None
        lab = run_lab_seconds(w, prompt_lens, lab_settings(engine), cost)
    finally:
        del engine
        gc.collect()
    tokens = w.total_output_tokens
    lab_summary = summarize(lab["result"])
    row = {"real_wall_s": round(real["wall_s"], 3), "lab_s": round(lab["time_s"], 3),
           "real_tok_s": round(tokens / real["wall_s"], 2),
           "lab_tok_s": round(tokens / lab["time_s"], 2),
           "real_steps": len(real["steps"]), "lab_steps": lab["forward_steps"]}
    if after is not None:
        drafts = after["num_drafts"] - before["num_drafts"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
        row["real_spec"] = {"num_drafts": drafts, "num_draft_tokens": draft_tokens,
                            "num_accepted_tokens": accepted,
                            "mean_acceptance_length": round(1 + accepted / drafts, 3)
                            if drafts else None}
        ls = lab_summary["spec_decoding"]
        row["lab_spec"] = {k: ls[k] for k in ("num_drafts", "num_draft_tokens",
                                              "num_accepted_tokens")}
        row["lab_spec"]["mean_acceptance_length"] = round(ls["mean_acceptance_length"], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    ap.add_argument("--cost-model", default="smollm2-cpu")
    ap.add_argument("--slots", default="1,4,8")
    ap.add_argument("--acceptance", default="0.5,0.8",
                    help="per-draft acceptance a: draft j is accepted with a^j")
    ap.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    slots_list = [int(x) for x in args.slots.split(",")]
    rates = [float(x) for x in args.acceptance.split(",")]
    cost = load_cost_model(args.cost_model)
    w = build_workload("mix", seed=args.seed, num_requests=args.num_requests)
    t0 = time.time()
    rows = []
    for slots in slots_list:
        off = one_arm(slots, None, w, cost, args.model, args.seed)
        print(json.dumps({"slots": slots, "off": off}), file=sys.stderr, flush=True)
        for a in rates:
            on = one_arm(slots, synthetic(args.k, a), w, cost, args.model, args.seed)
            real_gain = on["real_tok_s"] / off["real_tok_s"]
            lab_gain = on["lab_tok_s"] / off["lab_tok_s"]
            row = {"slots": slots, "acceptance": a, "off": off, "on": on,
                   "real_gain": round(real_gain, 3), "lab_gain": round(lab_gain, 3),
                   "lab_gain_error": round(lab_gain / real_gain - 1, 4),
                   "within_15pct": abs(lab_gain / real_gain - 1) <= 0.15}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "off"}), file=sys.stderr,
                  flush=True)
    report = {"kind": "lab_vs_engine_spec", "model": args.model or "default",
              "cost_model": args.cost_model, "k": args.k, "workload": w.summary(),
              "machine": machine_info(), "wall_s": round(time.time() - t0, 1),
              "results": rows}
    print(f"\n{'slots':>5} {'a':>4} {'real off':>9} {'real on':>8} {'gain':>6} "
          f"{'lab off':>8} {'lab on':>7} {'gain':>6} {'lab/real':>8}")
    for r in rows:
        print(f"{r['slots']:>5} {r['acceptance']:>4} {r['off']['real_tok_s']:>9.1f} "
              f"{r['on']['real_tok_s']:>8.1f} {r['real_gain']:>6.2f} "
              f"{r['off']['lab_tok_s']:>8.1f} {r['on']['lab_tok_s']:>7.1f} "
              f"{r['lab_gain']:>6.2f} {1 + r['lab_gain_error']:>8.3f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
