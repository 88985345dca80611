"""`--tokenizer x.gguf` load time: `Tokenizer.from_path` (the loader's header parser, key/value
metadata only) against building the same tokenizer from gguf-py's `GGUFReader` (the
library's way: it also parses every tensor's info into numpy views).

Same process, alternating, medians of `--repeats`; the two tokenizers are checked equal on a
few strings. Only the header pages of the file are read (no weights).

    python benchmarks/bench_tokenizer_load.py ~/.cache/iterserve-models/smollm2-1.7b/\\
smollm2-1.7b.Q4_K_M.gguf ~/.cache/iterserve-models/llama-3.1-8b-like/llama-3.1-8b-like.Q4_K_M.gguf \\
        [--repeats 5] [--out benchmarks/results/tokenizer-load-gguf.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

TEXTS = ["Hello world", "def f(x):\n    return x * 2024", "日本語 and émojis 🎉"]


def measure(path: str, repeats: int) -> dict:
    import gguf

    from iterserve.model.tokenizer import Tokenizer
    before, after = [], []
    for r in range(repeats):
        for name in (("reader", "from_path") if r % 2 == 0 else ("from_path", "reader")):
            t = time.perf_counter()
            if name == "reader":
                ref = Tokenizer.from_gguf_metadata(gguf.GGUFReader(path))
                before.append(time.perf_counter() - t)
            else:
                tok = Tokenizer.from_path(path)
                after.append(time.perf_counter() - t)
    same = all(tok.encode(s) == ref.encode(s) for s in TEXTS) and tok.vocab_size == ref.vocab_size
    b, a = statistics.median(before), statistics.median(after)
    return {"file": os.path.basename(path), "file_bytes": os.path.getsize(path),
            "gguf_reader_s": round(b, 4), "from_path_s": round(a, 4), "speedup": round(b / a, 2),
            "same_tokens": same, "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for f in args.files:
        row = measure(os.path.expanduser(f), args.repeats)
        rows.append(row)
        print(f"{row['file']}: gguf-py reader {row['gguf_reader_s']:.3f} s, from_path "
              f"{row['from_path_s']:.3f} s ({row['speedup']:.1f}x), same tokens: "
              f"{row['same_tokens']}", flush=True)
    doc = {"kind": "tokenizer-load", "rows": rows, "load_avg_at_end": os.getloadavg()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
