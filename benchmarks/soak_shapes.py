"""The soak's RSS growth, isolated and load-independent (not in CI).

    python benchmarks/soak_shapes.py [--lengths 150] [--model PATH] [--out FILE]

One engine in this process (the bundled model unless --model); one prompt at a time of each
of --lengths distinct lengths (max_tokens 1), so every prefill step has a row count never
seen before, as a server's steps do when arrivals are spread out; then the same lengths
again. Reported after each group of 25 lengths: glibc's in-use heap (mallinfo2: live
allocations, torch's and oneDNN's included; `free` is what the allocator holds unused) and
RSS. Memory, not time, so a loaded machine changes how long it takes, not the numbers.

Without a bound on the row counts (model/layers.py `onednn_linear` keeps one), every new row
count adds one oneDNN/ideep primitive per weight shape to caches of 1,024 entries each (~0.6 MB
per shape), so in-use grows with every new length and only the second pass (cache hits) is flat.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def heap() -> dict:
    fn = ctypes.CDLL("libc.so.6").mallinfo2
    fn.restype = _MallInfo2
    m = fn()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"in_use_mb": round(m.uordblks / 2**20, 1), "free_mb": round(m.fordblks / 2**20, 1),
            "rss_mb": round(rss / 2**20, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, default=150)
    ap.add_argument("--first", type=int, default=8, help="shortest prompt (tokens)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from iterserve import LLM, SamplingParams
    import iterserve.model.layers as layers

    llm = LLM(args.model)
    sp = SamplingParams(max_tokens=1, temperature=0)
    ids = llm.get_tokenizer().encode("tell me something about the sea. " * 40,
                                     add_special_tokens=False)

    def one(n: int) -> None:
        llm.generate({"prompt_token_ids": (ids * (n // len(ids) + 1))[:n]}, sp, use_tqdm=False)

    one(4)
    points = [{"pass": 0, "lengths": 0, **heap()}]
    t0 = time.perf_counter()
    lengths = range(args.first, args.first + args.lengths)
    for p in (1, 2):
        for i, n in enumerate(lengths, 1):
            one(n)
            if i % 25 == 0 or i == len(lengths):
                points.append({"pass": p, "lengths": i, **heap()})
                print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    first = [q for q in points if q["pass"] == 1]
    second = [q for q in points if q["pass"] == 2]
    result = {
        "fix": hasattr(layers, "onednn_linear"), "lengths": args.lengths,
        "in_use_growth_pass1_mb": round(first[-1]["in_use_mb"] - points[0]["in_use_mb"], 1),
        "in_use_growth_pass2_mb": round(second[-1]["in_use_mb"] - first[-1]["in_use_mb"], 1),
        "in_use_mb_per_new_length": round((first[-1]["in_use_mb"] - points[0]["in_use_mb"])
                                          / args.lengths, 3),
        "seconds": round(time.perf_counter() - t0, 1), "points": points,
        "load_average": os.getloadavg()}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "points"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
