"""Where one decode step's time goes, at batch 8 on the default model.

Two views of the same steps (a warm engine, 8 sequences past their prefill):
- cProfile over `LLMEngine.step`: scheduler (`Scheduler.schedule` + `update_from_output`),
  the model runner (inputs, forward, LM head) without the sampler, the sampler, and the engine's own Python (detokenise, outputs) as the rest;
- the native kernels (ctypes calls, which torch.profiler cannot see) from the same cProfile:
  a decode-only step runs all its layers in one call (kernels/decode_layers.c), so the
  layers' GEMMs, attention and elementwise ops show up as one figure, the LM head apart;
- torch.profiler over the forward: GEMMs (aten::linear/addmm/mm/matmul), attention (the
  paged-attention functions' self time plus SDPA/softmax/bmm ops), other tensor ops.

    python benchmarks/profile_decode.py [--batch 8] [--steps 16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

GEMM_OPS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul")
ATTN_OPS = ("aten::scaled_dot_product_attention", "aten::_softmax", "aten::softmax",
            "aten::bmm", "aten::baddbmm", "aten::index_select", "aten::index_put_",
            "aten::gather", "aten::index")


def warm_engine(batch: int, steps: int, model: str | None = None, engine_args: dict | None = None):
    from iterserve.bench.workloads import make_prompt
    from iterserve.core.request import SamplingParams
    from iterserve.engine.args import EngineArgs
    from iterserve.engine.llm_engine import LLMEngine

    kw = {"max_num_seqs": batch, "model": model, **(engine_args or {})}
    if model is not None and "num_kv_blocks" not in kw:
        kw["num_kv_blocks"] = batch * (4 * steps + 32) // 16 + 2 * batch   # what the run needs
    engine = LLMEngine.from_engine_args(EngineArgs(**kw))
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=4 * steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", make_prompt(16, rng), sp)
    started: set[str] = set()
    while len(started) < batch:
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
    for _ in range(2):
        engine.step()
    return engine


def _cum(stats: pstats.Stats, needle: str) -> float:
    return sum(v[3] for k, v in stats.stats.items() if needle in f"{k[0]}:{k[2]}")


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model", default=None, help="a .gguf file or HF directory (default: "
                    "the bundled model)")
    ap.add_argument("--threads", type=int, default=0, help="torch/kernel threads (default: "
                    "torch's; 1 is far less noisy on a loaded machine)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = warm_engine(args.batch, args.steps, args.model)
    # plain steps first (no profiler): wall time, and this thread's CPU time, which a loaded
    # machine disturbs far less (with --threads 1 all the work runs on this thread)
    t, c = time.perf_counter(), time.thread_time()
    for _ in range(args.steps):
        engine.step()
    plain_wall, plain_cpu = time.perf_counter() - t, time.thread_time() - c

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    wall = time.perf_counter() - t
    st = pstats.Stats(prof)
    split = {"scheduler": _cum(st, "core/scheduler.py:schedule")
             + _cum(st, "core/scheduler.py:update_from_output"),
             "sampler": _cum(st, "model/sampler.py:__call__")}
    # the runner's execute = tensors in + forward (+ LM head) + sampler
    split["model_runner_without_sampler"] = _cum(st, "model/runner.py:execute") - split["sampler"]
    step_total = _cum(st, "engine/llm_engine.py:step")
    split["engine_python_rest"] = step_total - sum(split.values())
    # the native kernels are ctypes calls, invisible to torch.profiler: time them here
    # decode-only steps of up to layers.QUANT_MAX_ROWS rows run every layer in one native
    # call (llama._decode_layers: GEMMs, attention, norms, RoPE, SiLU); the LM head and the
    # other paths still go through quant.matmul / _decode_attention
    native = {"native_decode_layers (all layers, one call)": _cum(st, "model/llama.py:_decode_layers"),
              "native_gemm (kernels.qgemm: LM head, unfused steps)":
                  _cum(st, "kernels/__init__.py:qgemm") + _cum(st, "model/quant.py:matmul"),
              "native_decode_attention (unfused steps)":
                  _cum(st, "model/attention.py:_decode_attention")}

    with profile(activities=[ProfilerActivity.CPU]) as tp:
        for _ in range(args.steps):
            engine.step()
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in tp.key_averages()}
    total_ops = sum(ops.values())
    gemm = sum(v for k, v in ops.items() if k in GEMM_OPS)
    attn = sum(v for k, v in ops.items() if k in ATTN_OPS or "scaled_dot_product" in k)
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:12]

    per_step = lambda s: round(s / args.steps * 1e3, 3)  # noqa: E731
    doc = {"kind": "decode-profile", "batch": args.batch, "steps": args.steps,
           "tree": str(Path(__file__).resolve().parents[1]),
           "threads": torch.get_num_threads(), "step_ms": per_step(wall),
           "plain_step_ms": per_step(plain_wall), "plain_step_thread_cpu_ms": per_step(plain_cpu),
           "cprofile_ms_per_step": {k: per_step(v) for k, v in split.items()},
           "native_kernels_ms_per_step (cProfile, inside the runner)":
               {k: per_step(v) for k, v in native.items()},
           "torch_ops_ms_per_step": {"gemm": per_step(gemm), "attention_ops": per_step(attn),
                                     "other_ops": per_step(total_ops - gemm - attn)},
           "top_ops_ms_per_step": {k: per_step(v) for k, v in top}}
    print(json.dumps(doc, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
