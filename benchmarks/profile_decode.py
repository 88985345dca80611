"""Where one decode step's time goes (default: batch 8; any model file, e.g. the 1.7B Q4_K_M).

A warm engine with `--batch` sequences past their prefill runs `--steps` decode steps three
ways, each a view the others cannot give:

1. **timed** (the figures in the table): light wrappers (one perf_counter pair per call) around
   the engine step, the scheduler, the runner, the model forward, the fused decode call, the
   LM head and the sampler, plus the native phase timers inside the fused decode call
   (kernels/decode_layers.c `iterserve_decode_profile`): per layer phase (RMSNorm, q/k/v GEMM,
   RoPE, KV write, attention, o GEMM, gate/up GEMM, SiLU x up, down GEMM, residual adds) and
   per weight type (Q4_K, Q6_K, ...). Each GEMM row also gets the bytes of weights it read
   per step and the GB/s that makes, against the machine's read bandwidth (`--bandwidth`:
   benchmarks/roofline.py's measurement) when asked for. Everything not inside a native call
   is "Python": the step loop, scheduler, metadata building, ctypes marshalling.
2. **plain**: the same steps with every timer off: the step time the figures should add up to
   (the timers' own cost is the difference; it is small: ~25 clock reads per layer).
3. **cProfile** over the steps: the Python functions that cost most (`--top`), to find what
   to cut outside the kernels.
4. **Python alone**: the same step loop with every native call a no-op (runs last: the tokens
   are garbage afterwards): the Python per step in wall ms and in this thread's CPU ms, the
   figure a loaded machine disturbs least.

    python benchmarks/profile_decode.py --model ~/.cache/iterserve-models/smollm2-1.7b/\\
smollm2-1.7b.Q4_K_M.gguf --batch 8 --steps 16 --bandwidth --out results/bench-profile.json

Under load every wall figure is noise; the *shares* are steadier, and `--threads 1` (one
thread does all the work) is steadier still. The JSON has every figure per step in ms; a
markdown table goes next to it (`.md`) and to stdout.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import functools
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

# decode_layers.c's phase slots (enum PROF_*): name, and the Linear a GEMM phase runs
PHASES = {0: ("rmsnorm (ln1 + ln2)", None), 1: ("gemm q/k/v", "qkv"),
          2: ("q/k/v bias + q/k norm", None), 3: ("rope", None), 4: ("kv write + q copy", None),
          5: ("attention", None), 6: ("gemm o", "o"), 7: ("residual adds", None),
          8: ("gemm gate/up", "gate_up"), 9: ("silu x up", None), 10: ("gemm down", "down"),
          12: ("experts: router, gate/up, silu, down", "experts")}
PROF_CALL, PROF_TYPE0 = 11, 16


def warm_engine(batch: int, steps: int, model: str | None = None, engine_args: dict | None = None,
                prompt_len: int = 16):
    from iterserve.bench.workloads import make_prompt
    from iterserve.core.request import SamplingParams
    from iterserve.engine.args import EngineArgs
    from iterserve.engine.llm_engine import LLMEngine

    kw = {"max_num_seqs": batch, "model": model, **(engine_args or {})}
    if model is not None and "num_kv_blocks" not in kw:
        kw["num_kv_blocks"] = batch * (prompt_len + 4 * steps + 48) // 16 + 2 * batch
    engine = LLMEngine.from_engine_args(EngineArgs(**kw))
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=4 * steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", make_prompt(prompt_len, rng), sp)
    started: set[str] = set()
    while len(started) < batch:
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
    for _ in range(2):
        engine.step()
    return engine


class Timers:
    """Wall seconds per name, from wrappers put around bound methods / functions."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}
        self.on = False
        self._undo: list = []

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        acc = self.acc
        acc.setdefault(name, 0.0)

        @functools.wraps(fn)
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t
        had = attr in vars(obj) if hasattr(obj, "__dict__") else False
        setattr(obj, attr, timed)
        self._undo.append((obj, attr, fn if had else None))

    def unwrap(self) -> None:
        for obj, attr, fn in reversed(self._undo):
            if fn is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, fn)
        self._undo.clear()


def _native_profiler():
    """(enable(acc or None), slots) for decode_layers.c's phase timers, or None when the
    library lacks them (an older build)."""
    from iterserve.model import kernels
    if not kernels.available():
        return None
    lib = kernels._lib()
    fn = getattr(lib, "iterserve_decode_profile", None)
    if fn is None:
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
    slots = fn(None)
    return fn, slots


def _type_name(t: int) -> str:
    from iterserve.model import kernels
    try:
        return kernels.build._type_names().get(t, f"type{t}")
    except Exception:               # noqa: BLE001 - a name is only a label
        return f"type{t}"


def weight_bytes(model) -> dict:
    """Bytes of encoded weights one decode step reads: per fused-decode role, per type, and
    the LM head's (segments' own storage, as the kernels stream them)."""
    roles: dict[str, int] = {"qkv": 0, "o": 0, "gate_up": 0, "down": 0, "experts": 0}
    types: dict[int, int] = {}

    def add(role: str, lin, share: float = 1.0) -> None:
        if lin.encoded is None:
            return
        for t, w in lin.encoded.segments:
            nb = int(w.numel() * w.element_size() * share)
            roles[role] += nb
            types[int(t)] = types.get(int(t), 0) + nb

    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        add("qkv", a.qkv_proj)
        add("o", a.o_proj)
        if hasattr(mlp, "experts"):     # a token reads its top_k experts: their average share
            share = mlp.top_k / mlp.num_experts
            for e in mlp.experts:
                add("experts", e.gate_up_proj, share)
                add("experts", e.down_proj, share)
            continue
        add("gate_up", mlp.gate_up_proj)
        add("down", mlp.down_proj)
    head = model.lm_head
    head_types = [] if head.encoded is None else [int(t) for t, _ in head.encoded.segments]
    head_bytes = sum(w.numel() * w.element_size() for _, w in head.encoded.segments) \
        if head.encoded is not None else head.weight.numel() * head.weight.element_size()
    return {"roles": roles, "types": types, "lm_head": head_bytes, "lm_head_types": head_types,
            "lm_head_path": head.compute_path()}


def profile(engine, steps: int, top: int = 25) -> dict:
    runner = engine.executor.runner if hasattr(engine.executor, "runner") else engine.executor
    model = runner.model
    T = Timers()
    T.wrap(engine, "step", "step")
    T.wrap(engine.scheduler, "schedule", "scheduler.schedule")
    T.wrap(engine.scheduler, "update_from_output", "scheduler.update_from_output")
    T.wrap(runner, "execute", "runner.execute")
    T.wrap(runner, "_run", "runner._run")
    T.wrap(model, "forward", "model.forward")
    T.wrap(model, "_decode_layers", "model._decode_layers")
    T.wrap(model, "logits", "lm_head (model.logits)")
    T.wrap(runner, "sampler", "sampler")
    import iterserve.model.runner as runner_mod
    T.wrap(runner_mod, "build_metadata", "build_metadata")
    native = _native_profiler()
    acc = (ctypes.c_double * native[1])() if native else None

    # timed steps, plain steps, timed again (alternating halves the drift between them)
    import resource
    flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    plain, timed = [], []
    for half in range(2):
        for _ in range(steps // 2):
            t = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - t)
        T.on = True
        if native:
            native[0](ctypes.addressof(acc))
        for _ in range(steps // 2):
            t = time.perf_counter()
            engine.step()
            timed.append(time.perf_counter() - t)
        T.on = False
        if native:
            native[0](None)
    n = len(timed)
    # minor page faults per step: first writes into the lazily mapped KV pool (a fresh page
    # per 4 KiB of K or V rows) show up here, and in the "kv write" phase
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0) / (len(plain) + n)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(max(2, steps // 2)):
        engine.step()
    prof.disable()
    ncp = max(2, steps // 2)
    T.unwrap()

    ms = lambda s, k=n: round(s / k * 1e3, 3)  # noqa: E731
    a = {k: ms(v) for k, v in T.acc.items()}
    doc: dict = {"steps_timed": n, "step_ms_plain_median": round(statistics.median(plain) * 1e3, 3),
                 "step_ms_timed_median": round(statistics.median(timed) * 1e3, 3),
                 "step_ms_timed_mean": ms(sum(timed)), "wrappers_ms": a,
                 "minor_page_faults_per_step": round(faults, 1)}
    wb = weight_bytes(model)
    doc["weight_bytes_per_step"] = {"roles": wb["roles"],
                                    "types": {_type_name(t): b for t, b in wb["types"].items()},
                                    "lm_head": wb["lm_head"],
                                    "lm_head_types": [_type_name(t) for t in wb["lm_head_types"]],
                                    "lm_head_path": wb["lm_head_path"]}
    # the breakdown: every ms of a step in exactly one row
    rows: list[tuple[str, float, int | None]] = []      # (what, ms per step, bytes read)
    fused = a.get("model._decode_layers", 0.0)
    if native and fused:
        ph = {i: ms(acc[i]) for i in PHASES}
        call = ms(acc[PROF_CALL])
        for i, (name, role) in PHASES.items():
            if ph[i] or role:
                rows.append((f"layers: {name}", ph[i], wb["roles"].get(role) if role else None))
        rows.append(("layers: checks, scratch, loop (inside the call)", call - sum(ph.values()),
                     None))
        rows.append(("Python around the fused call (ctypes, checks)", fused - call, None))
        doc["gemm_by_type_ms"] = {_type_name(t - PROF_TYPE0): ms(acc[t])
                                  for t in range(PROF_TYPE0, native[1]) if acc[t]}
        doc["gemm_by_type_bytes"] = {_type_name(t): b for t, b in wb["types"].items()}
    else:
        rows.append(("layers (fused call, no phase timers)" if fused else
                     "layers (per-module path)", fused or a.get("model.forward", 0.0), None))
    head = a.get("lm_head (model.logits)", 0.0)
    rows.append((f"LM head ({'+'.join(doc['weight_bytes_per_step']['lm_head_types']) or 'dense'},"
                 f" {wb['lm_head_path']})", head, wb["lm_head"]))
    rows.append(("sampler", a.get("sampler", 0.0), None))
    fwd_rest = a.get("model.forward", 0.0) - (fused if native or fused else 0.0)
    rows.append(("forward outside the layers (embedding, rope tables, final norm)", fwd_rest, None))
    rows.append(("build_metadata (block tables, slots)", a.get("build_metadata", 0.0), None))
    run_rest = a.get("runner._run", 0.0) - a.get("model.forward", 0.0) - head \
        - a.get("build_metadata", 0.0)
    rows.append(("runner: states, token/position tensors, row select", run_rest, None))
    rows.append(("runner.execute outside _run and the sampler",
                 a.get("runner.execute", 0.0) - a.get("runner._run", 0.0) - a.get("sampler", 0.0),
                 None))
    sched = a.get("scheduler.schedule", 0.0) + a.get("scheduler.update_from_output", 0.0)
    rows.append(("scheduler (schedule + update_from_output)", sched, None))
    rows.append(("engine step outside runner and scheduler (outputs, detokenise, stats)",
                 a.get("step", 0.0) - a.get("runner.execute", 0.0) - sched, None))
    doc["breakdown_ms"] = [{"what": w, "ms": round(v, 3), **({"weight_bytes": b} if b else {})}
                           for w, v, b in rows]
    st = pstats.Stats(prof)
    fns = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]    # by own (tottime)
    doc["cprofile_top_tottime_ms"] = [
        {"fn": f"{Path(k[0]).name}:{k[1]}:{k[2]}", "calls_per_step": round(v[1] / ncp, 2),
         "tottime_ms": round(v[2] / ncp * 1e3, 4), "cumtime_ms": round(v[3] / ncp * 1e3, 4)}
        for k, v in fns]
    return doc


def native_work_entries() -> list[str]:
    """The kernel library's entries that do work on buffers: every entry of its function table
    (`kernels._abi.ARGTYPES`, as iterserve.h declares them) that takes a pointer, but the ABI
    self-description and the configuration. What Python alone stubs, taken from the table so that a kernel added
    later is stubbed too. The others take integers only: pure ISA / dispatch queries
    (`iterserve_can_gemm8`, `iterserve_route`, ...) that stay real, so the step takes
    the same Python path as with the kernels."""
    from iterserve.model import kernels
    return [n for n, (_, args) in kernels._abi.ARGTYPES.items()
            if ctypes.c_void_p in args
            and n not in ("iterserve_abi", "iterserve_configure", "iterserve_config_state")]


def python_only(engine, steps: int) -> dict:
    """The step loop with every native kernel call made a no-op (`native_work_entries`, and
    the fused layers' own function pointer): what is left is the Python of a decode step
    (scheduler, runner, metadata, sampler, outputs, ctypes marshalling), in wall and in this
    thread's CPU ms (the latter barely moves with the machine's load). The tokens are
    garbage afterwards, so this runs last. `python_only_native_calls`: the stubbed entries
    the loop called, and how often."""
    from iterserve.model import kernels
    lib = kernels._lib()
    names = native_work_entries()
    saved = {n: getattr(lib, n) for n in names}
    calls: dict[str, int] = {}

    def stub(name):
        def noop(*a):
            calls[name] = calls.get(name, 0) + 1
            return 0                 # what the kernels return for "done" (or nothing at all)
        return noop

    runner = engine.executor.runner if hasattr(engine.executor, "runner") else engine.executor
    fused = getattr(runner.model, "_fused", None)
    fused_fn = fused._fn if fused is not None else None
    try:
        for n in names:
            setattr(lib, n, stub(n))
        if fused is not None:
            fused._fn = stub("decode_layers (fused)")
        for _ in range(3):
            engine.step()
        wall, cpu = [], []
        for _ in range(steps):
            t, c = time.perf_counter(), time.thread_time()
            engine.step()
            wall.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
    finally:
        for n, fn in saved.items():
            setattr(lib, n, fn)
        if fused is not None:
            fused._fn = fused_fn
    return {"python_only_step_ms_median": round(statistics.median(wall) * 1e3, 3),
            "python_only_step_thread_cpu_ms_median": round(statistics.median(cpu) * 1e3, 3),
            "python_only_steps": steps, "python_only_native_calls": dict(sorted(calls.items()))}


def table(doc: dict) -> str:
    bw = doc.get("bandwidth_gbs_best")
    total = doc["step_ms_timed_mean"]
    head = f"| part | ms per step | share | weight MB | GB/s |{' of bw |' if bw else ''}"
    lines = [f"### One decode step at batch {doc['batch']}: {doc['model']} "
             f"({doc['threads']} threads)", "",
             f"Step {doc['step_ms_timed_mean']:.2f} ms timed (mean), plain median "
             f"{doc['step_ms_plain_median']:.2f} ms; load average {doc['load_1m']}; "
             f"{doc.get('minor_page_faults_per_step', '?')} minor page faults per step.", "",
             head, "|---|---|---|---|---|" + ("---|" if bw else "")]
    for r in doc["breakdown_ms"]:
        b = r.get("weight_bytes")
        gbs = b / (r["ms"] * 1e-3) / 1e9 if b and r["ms"] > 0 else None
        cells = [r["what"], f"{r['ms']:.3f}", f"{100 * r['ms'] / total:.1f}%",
                 f"{b / 1e6:.1f}" if b else "", f"{gbs:.1f}" if gbs else ""]
        if bw:
            cells.append(f"{gbs / bw:.2f}" if gbs else "")
        lines.append("| " + " | ".join(cells) + " |")
    acc = sum(r["ms"] for r in doc["breakdown_ms"])
    lines.append(f"| **sum** | {acc:.3f} | {100 * acc / total:.1f}% | | |" + (" |" if bw else ""))
    if "python_only_step_ms_median" in doc:
        lines += ["", f"Python alone (every native call a no-op, {doc['python_only_steps']} "
                  f"steps): {doc['python_only_step_ms_median']:.3f} ms per step wall, "
                  f"{doc['python_only_step_thread_cpu_ms_median']:.3f} ms of this thread's "
                  f"CPU ({100 * doc['python_only_step_thread_cpu_ms_median'] / doc['step_ms_plain_median']:.1f}% "
                  "of the plain step)."]
    if doc.get("gemm_by_type_ms"):
        lines += ["", "| layer GEMMs by weight type | ms per step | weight MB | GB/s |"
                  + (" of bw |" if bw else ""), "|---|---|---|---|" + ("---|" if bw else "")]
        for t, v in doc["gemm_by_type_ms"].items():
            b = doc["gemm_by_type_bytes"].get(t)
            gbs = b / (v * 1e-3) / 1e9 if b and v else None
            lines.append(f"| {t} | {v:.3f} | {b / 1e6 if b else 0:.1f} | "
                         f"{gbs or 0:.1f} |" + (f" {gbs / bw:.2f} |" if bw and gbs else
                                                (" |" if bw else "")))
    lines += ["", "Top Python functions by own time (cProfile, ms per step):", "",
              "| function | calls | own ms | cum ms |", "|---|---|---|---|"]
    for f in doc["cprofile_top_tottime_ms"][:12]:
        lines.append(f"| {f['fn']} | {f['calls_per_step']} | {f['tottime_ms']:.3f} | "
                     f"{f['cumtime_ms']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens of context per sequence")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model", default=None, help="a .gguf file or HF directory (default: "
                    "the bundled model)")
    ap.add_argument("--threads", type=int, default=0, help="torch/kernel threads (default: "
                    "torch's; 1 is far less noisy on a loaded machine)")
    ap.add_argument("--bandwidth", action="store_true",
                    help="measure the read bandwidth first (roofline.py) for the GB/s columns")
    ap.add_argument("--top", type=int, default=25, help="cProfile functions kept in the JSON")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineArgs field (e.g. kernel_activations=float), repeatable")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bw = None
    if args.bandwidth:
        import roofline
        bw = roofline.read_bandwidth((1, 2))
    eargs = {}
    for kv in args.engine_arg:
        k, _, v = kv.partition("=")
        eargs[k] = int(v) if v.isdigit() else v
    engine = warm_engine(args.batch, args.steps, args.model, eargs, args.prompt_len)
    doc = {"kind": "decode-profile", "batch": args.batch,
           "model": Path(args.model).name if args.model else "bundled",
           "tree": str(HERE.parent), "threads": torch.get_num_threads(),
           "engine_args": eargs, "prompt_len": args.prompt_len}
    if bw:
        doc["bandwidth_gbs"] = bw
        doc["bandwidth_gbs_best"] = max(bw.values())
    doc.update(profile(engine, args.steps, args.top))
    doc.update(python_only(engine, max(20, args.steps)))
    import os
    doc["load_1m"] = round(os.getloadavg()[0], 2)
    md = table(doc)
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
        args.out.with_suffix(".md").write_text(md + "\n")
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
