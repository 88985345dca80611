"""Reasoning output: split a model's thinking from its answer (`--reasoning-parser`, vLLM's
names deepseek_r1, qwen3, openai_gptoss) and keep constraints on the answer. Torch-free."""

from iterserve.reasoning.grammar import answer_only
from iterserve.reasoning.parsers import (
    REASONING_PARSERS, ReasoningParser, ReasoningStream, Split, get_reasoning_parser)

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "Split",
           "get_reasoning_parser", "answer_only"]
