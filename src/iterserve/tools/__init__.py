"""Tool calling: parse the calls a model writes (hermes, llama3_json, mistral, openai: gpt-oss's
harmony, as vLLM names them), stream them as OpenAI deltas, and force them with structured outputs for
`tool_choice` "required" or a named function (`tool_choice_constraint`). Torch-free."""

from iterserve.tools.choice import tool_choice_constraint
from iterserve.tools.parsers import (
    TOOL_PARSERS, HermesToolParser, Llama3JsonToolParser, MistralToolParser, ToolCallStream,
    ToolParser, get_tool_parser)
from iterserve.tools.types import (
    DeltaMessage, DeltaToolCall, ExtractedToolCalls, ToolCall, make_tool_call_id)
from iterserve.tools import harmony  # noqa: E402,F401  (registers the "openai" parser)

__all__ = [
    "TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
    "ToolCallStream", "ToolParser", "get_tool_parser",
    "tool_choice_constraint", "DeltaMessage", "DeltaToolCall", "ExtractedToolCalls",
    "ToolCall", "make_tool_call_id",
]
