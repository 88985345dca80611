"""Per-step cost of structured outputs: fill_bitmask for 8 constrained rows, one batched
apply on [16, V] logits, and the 8 accepts, walking a JSON document token by token.

Printed for the bundled SmolLM2 vocabulary (49,152): `python benchmarks/bench_structured.py`.
A benchmark, not a test: timings on a shared machine are not assertions.
Seen on 2026-12-01: with other processes busy on both cores the batched apply's median went
from ~0.3 ms to ~95 ms (torch's 2-thread ops waiting for a descheduled thread), so run it on
an idle machine or with torch.set_num_threads(1).
"""

import json
import statistics
import time

import torch

from iterserve.structured import StructuredOutputsParams as P
from iterserve.structured.backend import StructuredOutputCompiler
from iterserve.structured.bitmask import allocate_bitmask, apply_bitmask, fill_bitmasks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "tags"]}
DOC = json.dumps({"name": "Ada Lovelace, Countess of Lovelace", "age": 36,
                  "city": "London, United Kingdom",
                  "tags": ["mathematician", "writer", "analytical engine", "first programmer"]},
                 indent=1)


def measure(tok, rows=8, batch=16):
    c = StructuredOutputCompiler(tok, tok.vocab_size)
    try:
        t0 = time.perf_counter()
        g = c.compile(P(json=SCHEMA))
        compile_ms = (time.perf_counter() - t0) * 1e3
        ids = tok.encode(DOC, add_special_tokens=False)
        ms = [g.matcher() for _ in range(rows)]
        bm = allocate_bitmask(rows, c.vocab_size)
        logits = torch.randn(batch, tok.vocab_size)
        idx = list(range(0, batch, batch // rows))[:rows]
        steps = []
        for t in ids:
            t0 = time.perf_counter()
            fill_bitmasks(ms, bm)
            t1 = time.perf_counter()
            apply_bitmask(logits, bm, idx)
            t2 = time.perf_counter()
            assert all(m.accept(t) for m in ms)
            steps.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        assert all(m.is_terminated() for m in ms)
        med = [statistics.median(s[i] for s in steps) * 1e3 for i in range(3)]
        return compile_ms, len(ids), med
    finally:
        c.close()


def report(label, vocab, result):
    compile_ms, n, (fill, apply, accept) = result
    print(f"\n{label} (V={vocab}): compile {compile_ms:.1f} ms; per step over {n} steps, "
          f"8 rows: fill {fill:.3f} ms, apply [16x{vocab}] {apply:.3f} ms, "
          f"accept {accept:.3f} ms, total {fill + apply + accept:.3f} ms (median)")
    return fill + apply + accept


def main():
    import gguf
    from iterserve.model.default_model import default_model_path
    from iterserve.model.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf_metadata(gguf.GGUFReader(default_model_path()))
    report("SmolLM2-135M tokenizer", tok.vocab_size, measure(tok))


if __name__ == "__main__":
    main()
