"""vLLM as a peer, on a GPU device machine: same model, same workload, same client.

vLLM needs a CUDA GPU; on a CPU-only machine this script prints a note and exits 0 (the
peer is skipped, not failed). On a GPU machine with vLLM installed it starts
`vllm serve` on the default model's GGUF (vLLM reads GGUF; the tokenizer comes from the same
file), waits for /health, and runs `iterserve bench serve` against it.

    python benchmarks/peers/vllm_gpu.py --workload mix --out benchmarks/results/vllm_mix.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def skip_reason() -> str | None:
    """Why vLLM cannot run here, or None when it can."""
    try:
        import torch
        if not torch.cuda.is_available():
            return "no CUDA GPU on this machine (vLLM peer runs only on a device machine)"
    except ImportError:
        return "torch is not installed"
    if importlib.util.find_spec("vllm") is None and shutil.which("vllm") is None:
        return "vllm is not installed (pip install vllm on the device machine)"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mix")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    reason = skip_reason()
    if reason:
        note = {"kind": "peer-skipped", "engine": "vllm", "reason": reason}
        print(json.dumps(note))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(note, indent=1))
        return 0

    import httpx

    from iterserve.bench.client import run_workload
    from iterserve.bench.workloads import build_workload
    from llama_server import default_gguf

    model = args.model or str(default_gguf())
    cmd = ["vllm", "serve", model, "--port", str(args.port), "--host", "127.0.0.1",
           "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", "smollm2",
           "--max-model-len", "2048"]
    # For a .gguf vLLM reads the config and the tokenizer from the file itself (no hub).
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"vllm serve exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        doc = asyncio.run(run_workload(url, build_workload(args.workload)))
        doc["engine"] = "vllm"
        print(json.dumps(doc["summary"], indent=1))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=1))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
