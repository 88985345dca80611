"""Peak RSS and load time per model x format, iterserve beside llama-server (not CI).

For each checkpoint made by benchmarks/models.py (GGUFs and bf16 safetensors directories):
- iterserve: `iterserve generate --model M --max-tokens 1 --ignore-eos` in a fresh process
  under `/usr/bin/time`: peak RSS (max resident set, file-backed mapped pages included) and
  load time = process start to the one-token answer;
- llama-server (GGUF only, when benchmarks/peers/llama_server.py setup has built it): the
  same file with `-c` sized like iterserve's KV, load time = process start to the first
  token of a one-token completion, peak RSS = VmHWM of the server process.
The budget the issue sets is printed beside each row: 1.15 x file + KV + 400 MB.

    python benchmarks/memory.py --models smollm2-1.7b --kv-gib 0.5
Results go to benchmarks/results/memory.json (taken on whatever load the machine has: say so).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))
import models  # noqa: E402

MB = 1 << 20


def file_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return path.stat().st_size


def kv_bytes_per_token(name: str) -> int:
    c = models.hf_config(name)
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 4


def run_iterserve(model: Path, kv_gib: float, extra: list[str]) -> dict:
    cmd = ["/usr/bin/time", "-f", "MAXRSS_KB=%M", sys.executable, "-m", "iterserve.cli",
           "generate", "--model", str(model), "--kv-cache-memory", str(kv_gib),
           "--max-tokens", "1", "--ignore-eos", "--no-progress", *extra, "Hello there"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")})
    wall = time.monotonic() - t0
    m = re.search(r"MAXRSS_KB=(\d+)", p.stderr)
    return {"ok": p.returncode == 0, "load_s": round(wall, 2),
            "peak_rss_bytes": int(m.group(1)) * 1024 if m else None,
            "error": None if p.returncode == 0 else p.stderr[-800:]}


def run_llama_server(model: Path, ctx: int, port: int = 8097) -> dict:
    import httpx
    import llama_server as peer
    server = peer.BIN_DIR / "llama-server"
    if not server.exists():
        return {"ok": False, "error": "llama-server not built (benchmarks/peers/llama_server.py setup)"}
    cmd = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", "1",
           "-t", "2", "-c", str(ctx), "--no-webui"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                return {"ok": False, "error": f"llama-server exited {proc.returncode}"}
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        httpx.post(url + "/completion", json={"prompt": "Hello there", "n_predict": 1},
                   timeout=300)
        wall = time.monotonic() - t0
        hwm = None
        with open(f"/proc/{proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
        return {"ok": True, "load_s": round(wall, 2), "peak_rss_bytes": hwm}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-1.7b"])
    ap.add_argument("--kv-gib", type=float, default=0.5)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "memory.json"))
    args = ap.parse_args()
    rows = []
    for name in args.models:
        d = models.model_dir(name)
        candidates = sorted(d.glob("*.gguf")) + ([d / "hf-bf16"] if (d / "hf-bf16").is_dir() else [])
        for path in candidates:
            size = file_bytes(path)
            kv = int(args.kv_gib * (1 << 30))
            row = {"model": name, "format": path.name, "file_bytes": size, "kv_bytes": kv,
                   "budget_bytes": int(1.15 * size + kv + 400 * MB),
                   "iterserve": run_iterserve(path, args.kv_gib, [])}
            if path.suffix == ".gguf" and not args.no_peer:
                row["llama_server"] = run_llama_server(path, kv // kv_bytes_per_token(name))
            rows.append(row)
            it = row["iterserve"]
            print(f"{name:18s} {path.name:40s} file {size / 1e9:5.2f} GB  iterserve "
                  f"{(it['peak_rss_bytes'] or 0) / 1e9:5.2f} GB in {it['load_s']:5.1f} s  "
                  f"(budget {row['budget_bytes'] / 1e9:5.2f} GB)"
                  + (f"  llama-server {row['llama_server'].get('peak_rss_bytes', 0) / 1e9:5.2f} GB"
                     f" in {row['llama_server'].get('load_s', 0):5.1f} s"
                     if row.get("llama_server", {}).get("ok") else ""), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": os.uname().nodename, "cores": os.cpu_count(),
                                          "load_avg_at_end": os.getloadavg(), "rows": rows},
                                         indent=2))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
