"""iterserve: an LLM serving engine that schedules per token (iteration-level batching).

Layers, from the bottom (docs/ARCHITECTURE.md gives the whole order):
  errors.py  every error and its HTTP answer
  core/      request state, KV block manager, scheduler, cost model: pure Python, no torch
  model/     the model runner: loaders, transformer with a paged KV cache, tokenizer, sampler
  engine/    the engine loop (schedule -> execute -> update), offline LLM API, async engine
  lab/       the same scheduler on simulated time with a cost model
  server/    the OpenAI-compatible HTTP server and the /lab page
  bench/     benchmark clients and workloads
"""

__version__ = "0.1.0"

# The offline API at the top level, as vLLM has it: `from iterserve import LLM, SamplingParams`.
# Resolved on first use (PEP 562), so `import iterserve` (and the torch-free lab and core)
# does not import the engine, the model layer or torch.
_LAZY = {
    "LLM": "iterserve.engine.llm",
    "SamplingParams": "iterserve.core.request",
    "PoolingParams": "iterserve.core.request",
    "StructuredOutputsParams": "iterserve.structured.params",
    "RequestOutput": "iterserve.engine.outputs",
    "CompletionOutput": "iterserve.engine.outputs",
    "EngineArgs": "iterserve.engine.args",
    "LLMEngine": "iterserve.engine.llm_engine",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'iterserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value          # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
