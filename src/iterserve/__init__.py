"""iterserve: an LLM serving engine that schedules per token (iteration-level batching).

Layers, from the bottom (see docs/ARCHITECTURE.md):
  core/    request state, KV block manager, scheduler: pure Python, no torch
  model/   the model runner: loaders, transformer with a paged KV cache, tokenizer, sampler
  engine/  the engine loop (schedule -> execute -> update), offline LLM API, async engine
  server/  the OpenAI-compatible HTTP server and the /lab page
  lab/     the same scheduler on simulated time with a cost model
  bench/   benchmark clients and workloads
"""

__version__ = "0.1.0"
