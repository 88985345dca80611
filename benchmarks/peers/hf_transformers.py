"""HF transformers as a peer: static batches with `generate`, and HF's continuous batching.

Why two modes: `generate` on a padded batch is what most people run first; the batch lasts
until its longest member ends, so short requests waste slots (static batching). HF's own
continuous batching manager (transformers 5.x, `continuous_batching_context_manager`, the
machinery behind `generate_batch`) is the fair "HF at its best" point. Both load the *same*
weights as the other engines: the default model's GGUF, dequantised to float32 by
transformers' GGUF loader (`gguf_file=`).

`generate_batch` itself takes a single `max_new_tokens` for every prompt, so we drive its
manager directly with one `add_request(..., max_new_tokens=m, eos_token_id=-1)` per request:
same per-request lengths as the other engines, and -1 disables EOS (ignore_eos).

Offline (no HTTP): the workload is all at t=0, so wall time from first submit to last result
is comparable with the online engines' duration on `mix`.

    python benchmarks/peers/hf_transformers.py --mode static --max-num-seqs 8 --out r.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from iterserve.bench.client import machine_info  # noqa: E402
from iterserve.bench.workloads import Workload, build_workload  # noqa: E402


def load_model(threads: int = 2, model: str | None = None, dtype: str = "float32",
               gguf_path: str | None = None):
    """Tokenizer and model: an HF directory (safetensors, in `dtype`: "auto" keeps the
    checkpoint's) when `model` is given, else a GGUF file (`gguf_path`, default the bundled
    model's) dequantised to float32 (the same weights as every peer; 4 bytes a weight)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from llama_server import default_gguf  # sibling script

    torch.set_num_threads(threads)
    if model is not None:
        tok = AutoTokenizer.from_pretrained(model)
        dt = "auto" if dtype == "auto" else getattr(torch, dtype)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dt)
        hf.eval()
        return tok, hf
    gguf = Path(gguf_path).expanduser() if gguf_path else default_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # from_pretrained(gguf_file=) insists on `accelerate`; the same GGUF conversion code
    # (load_gguf_checkpoint: dequantise + HF names) works without it.
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True,
                                   model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF -> HF weights mismatch: missing {missing}, extra {unexpected}")
    model.tie_weights()
    model.eval()
    return tok, model


def _encode(tok, w: Workload) -> list[list[int]]:
    ids = [tok.encode(r.prompt, add_special_tokens=False) for r in w.requests]
    for r, x in zip(w.requests, ids):
        if len(x) != r.prompt_len:
            raise RuntimeError(f"request {r.index}: {len(x)} tokens, workload says {r.prompt_len}")
    return ids


def run_static(tok, model, w: Workload, max_num_seqs: int) -> dict:
    """Groups of `max_num_seqs` in arrival order, left-padded; each group generates until its
    longest member's max_tokens (min_new_tokens = max_new_tokens: nobody stops early)."""
    import torch

    ids = _encode(tok, w)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    reqs = list(w.requests)
    latencies, generated, steps = [], 0, 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for g in range(0, len(reqs), max_num_seqs):
            group = list(range(g, min(g + max_num_seqs, len(reqs))))
            width = max(len(ids[i]) for i in group)
            input_ids = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in group])
            mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in group])
            n = max(reqs[i].max_tokens for i in group)
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=pad)
            if out.shape[1] - width != n:
                raise RuntimeError(f"group generated {out.shape[1] - width} tokens, wanted {n}")
            generated += n * len(group)
            steps += n
            done = time.perf_counter() - t0
            latencies += [done] * len(group)
    wall = time.perf_counter() - t0
    useful = w.total_output_tokens
    return {"engine": "hf-static", "max_num_seqs": max_num_seqs, "wall_s": round(wall, 3),
            "steps": steps, "output_tokens": useful, "generated_tokens_incl_waste": generated,
            "slot_utilisation": round(useful / (steps * max_num_seqs), 4),
            "output_throughput": round(useful / wall, 3),
            "total_token_throughput": round((useful + w.total_prompt_tokens) / wall, 3),
            "mean_latency_s": round(sum(latencies) / len(latencies), 3)}


KV_PAGE = 64              # tokens per KV page (HF's default 256 over-allocates short requests)
MAX_BATCH_TOKENS = 512    # tokens per CB step: bounds the prefill's activations


def run_continuous(tok, model, w: Workload, max_num_seqs: int | None) -> dict:
    """HF's continuous batching manager, one request per workload entry, EOS disabled."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    ids = _encode(tok, w)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in w.requests),
                           eos_token_id=-1, pad_token_id=tok.pad_token_id or 0)
    # the KV cache sized for the workload: left alone, HF sizes it as 0.9 of the free memory
    # (its GPU rule, applied to host RAM: 16.4 GB peak RSS for the 1.7B bf16 on this 24 GB
    # machine); here every one of `max_num_seqs` running requests gets its longest need
    # (prompt + max_tokens) in pages of KV_PAGE tokens, as iterserve's run_models sizing does
    need = sorted(-(-(len(ids[r.index]) + r.max_tokens) // KV_PAGE) for r in w.requests)
    slots = max_num_seqs or len(need)
    cb_args = dict(page_size=KV_PAGE, num_blocks=sum(need[-slots:]) + slots,
                   max_batch_tokens=MAX_BATCH_TOKENS)
    cb = ContinuousBatchingConfig(max_requests_per_batch=max_num_seqs, **cb_args) \
        if max_num_seqs else ContinuousBatchingConfig(**cb_args)
    results: dict[str, object] = {}
    finish: dict[str, float] = {}
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True,
            timeout=30, warmup=False) as manager:
        t0 = time.perf_counter()
        rid = {manager.add_request(ids[r.index], request_id=f"r{r.index}",
                                   max_new_tokens=r.max_tokens, eos_token_id=-1): r
               for r in w.requests}
        while len(results) < len(rid):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching thread stopped early")
                continue
            if res.is_finished():
                results[res.request_id] = res
                finish[res.request_id] = time.perf_counter() - t0
        wall = time.perf_counter() - t0
    out_tokens = sum(len(res.generated_tokens) for res in results.values())
    if out_tokens != w.total_output_tokens:
        raise RuntimeError(f"HF CB generated {out_tokens} tokens, workload asks for "
                           f"{w.total_output_tokens}")
    return {"engine": "hf-continuous", "max_num_seqs": max_num_seqs or "auto",
            "wall_s": round(wall, 3), "output_tokens": out_tokens,
            "output_throughput": round(out_tokens / wall, 3),
            "total_token_throughput": round((out_tokens + w.total_prompt_tokens) / wall, 3),
            "mean_latency_s": round(sum(finish.values()) / len(finish), 3),
            "kv_num_blocks": cb_args["num_blocks"], "kv_page_tokens": KV_PAGE}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["static", "continuous"], required=True)
    ap.add_argument("--workload", default="mix")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="0 = HF's own choice (CB)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="an HF directory (default: the bundled GGUF)")
    ap.add_argument("--gguf", default=None, help="a GGUF file, dequantised to float32 "
                    "(default: the bundled model's; --model takes an HF directory instead)")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto (HF dirs)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    w = build_workload(args.workload, num_requests=args.num_requests)
    if w.rate is not None:
        raise SystemExit("the HF peer is offline: use a workload with all requests at t=0")
    tok, model = load_model(args.threads, args.model, args.dtype, args.gguf)
    if args.mode == "static":
        res = run_static(tok, model, w, args.max_num_seqs)
    else:
        res = run_continuous(tok, model, w, args.max_num_seqs or None)
    import torch
    import transformers
    with open("/proc/self/status") as f:           # peak resident set: weights + KV + work
        res["peak_rss_gb"] = next((round(int(line.split()[1]) / 2 ** 20, 3) for line in f
                                   if line.startswith("VmHWM")), None)
    res["model_dtype"] = str(model.dtype).replace("torch.", "")
    res["transformers"], res["torch"] = transformers.__version__, torch.__version__
    doc = {"kind": "offline-peer", "machine": machine_info(), "workload": w.summary(),
           "threads": args.threads, "model": args.model or args.gguf or "bundled GGUF",
           "dtype": args.dtype, **res}
    print(json.dumps(res))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
