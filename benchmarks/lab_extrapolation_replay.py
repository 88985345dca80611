"""How the cost model should price a step beyond its corrections' last knot, decided on a
real run: a quiet `slo_engine_tradeoffs.py --presets longprompt-heavy` result
(benchmarks/results/longprompt-heavy-chunk128-engine.json: the engine's numbers and the fit
made at the start of that run, knots up to 256 tokens) replayed through the lab with the
correction beyond the last knot held at its value, per token (corr(last) * tokens / last,
what `core.step_time.token_correction` does), or extended by the last segment's slope.
The engine's answer: chunking (budget 128) costs 7.9% of throughput, p99 ITL with chunking
off 1.43 / 1.39 s. Seconds to run; writes
benchmarks/results/lab-extrapolation-replay.json.

    PYTHONPATH=src .venv/bin/python benchmarks/lab_extrapolation_replay.py
"""
import json
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import iterserve.core.cost_model as cm
from iterserve.core.cost_model import CostModel
from slo_workloads import preset_options
import slo_engine_tradeoffs as t
RESULTS = Path(__file__).resolve().parent / "results"
res = json.load(open(RESULTS / "longprompt-heavy-chunk128-engine.json"))
fit = CostModel.from_dict({k: v for k, v in res["cost_model"].items() if k not in ("mean_abs_rel_error", "max_abs_rel_error")})
orig = cm.token_correction
def make(mode):
    def corr(knots, tokens):
        (t0, v0), (t1, v1) = knots[-2], knots[-1]
        if tokens <= t1 or mode == "proportional":
            return orig(knots, tokens)
        return v1 if mode == "held" else v1 + (v1 - v0) / (t1 - t0) * (tokens - t1)
    return corr
out = {"source": "benchmarks/results/longprompt-heavy-chunk128-engine.json (quiet; its own fit)", "modes": {}}
real = {}
for c in res["cases"]:
    real.setdefault(c["case"], []).append(c["real"])
out["real"] = {k: {"throughput_tokens_per_s": [r["throughput_tokens_per_s"] for r in v], "p99_itl_s": [r["p99_itl_s"] for r in v]} for k, v in real.items()}
for mode in ("held", "proportional", "slope"):
    cm.token_correction = make(mode)
    row = {}
    for c in res["cases"]:
        if c["case"] in row: continue
        opts = {**preset_options(c["preset"], **c["options"]), "cost_model": fit, "batching": "continuous"}
        lab = t.lab_run(opts)
        row[c["case"]] = {"throughput_tokens_per_s": lab["throughput_tokens_per_s"], "p99_itl_s": lab["p99_itl_s"], "p99_ttft_s": lab["p99_ttft_s"]}
    off, on = row["chunking off"], row["chunked, budget 128"]
    row["lab_throughput_cost_budget_128"] = 1 - on["throughput_tokens_per_s"] / off["throughput_tokens_per_s"]
    out["modes"][mode] = row
r = out["real"]
out["real_throughput_cost_budget_128"] = [1 - a / b for a, b in zip(r["chunked, budget 128"]["throughput_tokens_per_s"], r["chunking off"]["throughput_tokens_per_s"])]
json.dump(out, open(RESULTS / "lab-extrapolation-replay.json", "w"), indent=1)
for m, row in out["modes"].items():
    print(m, round(row["lab_throughput_cost_budget_128"], 4), round(row["chunking off"]["p99_itl_s"], 3), round(row["chunking off"]["throughput_tokens_per_s"], 2), round(row["chunked, budget 128"]["throughput_tokens_per_s"], 2))
print("real", out["real_throughput_cost_budget_128"])
