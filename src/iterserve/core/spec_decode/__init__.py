"""Speculative decoding's torch-free side: the config, the proposers, the per-step plan.

config.py (`--speculative-config`, vLLM's JSON), ngram.py (prompt lookup, synthetic, the
draft model's placeholders), suffix.py (suffix decoding), adaptive.py (how many drafts pay
this step), speculator.py (what the Scheduler owns: proposals, the plan, the counters).
The verification itself is the executor's (model/rejection_sampler.py; the lab's
SimExecutor draws it from an acceptance model).
"""

from iterserve.core.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from iterserve.core.spec_decode.ngram import DRAFT_PLACEHOLDER
from iterserve.core.spec_decode.speculator import SpecDecodingStats, Speculator

__all__ = ["SpeculativeConfig", "SpeculativeConfigError", "SpecDecodingStats", "Speculator",
           "DRAFT_PLACEHOLDER"]
