"""iterserve.tools.plan: the one ToolPlan behind the server's chat endpoint and the offline
`LLM.chat(tools=...)` (both paths are driven end to end in tests/server/test_tool_calling.py
and tests/engine/test_offline_llm.py); here the plan itself and that both policies build it
the same way."""

from types import SimpleNamespace

import pytest

from iterserve.core.request import SamplingParams
from iterserve.engine.chat_tools import plan_offline_tools, tool_params
from iterserve.errors import InvalidRequestError, ToolChoiceError
from iterserve.server.protocol import ChatCompletionRequest
from iterserve.server.serving_tools import ToolServerConfig, plan_tools
from iterserve.tools.plan import NO_TOOLS, ToolPlan, plan_tool_choice

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
TWO = ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n'
       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def _server(choice, parser="hermes", auto=True, parallel=None):
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 tools=[WEATHER, PING], tool_choice=choice,
                                 parallel_tool_calls=parallel)
    return plan_tools(body, ToolServerConfig(auto, parser if auto else None), None,
                      SamplingParams())


@pytest.mark.parametrize("choice", ["none", "auto", "required",
                                    {"type": "function", "function": {"name": "ping"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_server_and_offline_build_the_same_plan(choice, parallel):
    server_plan, server_params = _server(choice, parallel=parallel)
    _, offline_plan = plan_offline_tools([WEATHER, PING], choice, "hermes", parallel, None)
    assert server_plan == offline_plan
    assert server_params == tool_params(offline_plan, SamplingParams())
    assert (server_plan.constraint is not None) == (choice not in ("none", "auto"))


def test_extract_keeps_the_first_call_unless_parallel():
    many = plan_tool_choice([WEATHER, PING], "auto", parallel=True, auto_parser="hermes",
                            forced_format="hermes")
    one = plan_tool_choice([WEATHER, PING], "auto", parallel=False, auto_parser="hermes",
                           forced_format="hermes")
    assert [c.name for c in many.extract(TWO).tool_calls] == ["ping", "get_weather"]
    assert [c.name for c in one.extract(TWO).tool_calls] == ["ping"]
    assert NO_TOOLS.extract(TWO) is None and not NO_TOOLS.parses
    assert one.finish_reason("stop", True) == "tool_calls"
    assert one.finish_reason("length", True) == "length"
    named = ToolPlan("named", "hermes", False)
    assert named.finish_reason("stop", True) == "stop"


def test_sampling_params_force_the_call_and_keep_mistral_special_tokens():
    forced = plan_tool_choice([WEATHER], "required", parallel=False, auto_parser=None,
                              forced_format="mistral")
    sp = forced.sampling_params(SamplingParams(max_tokens=5))
    assert sp.structured_outputs is forced.constraint and sp.skip_special_tokens is False
    assert sp.max_tokens == 5
    auto = plan_tool_choice([WEATHER], "auto", parallel=True, auto_parser="hermes",
                            forced_format="hermes")
    base = SamplingParams()
    assert auto.sampling_params(base) is base                 # nothing to change
    with pytest.raises(ToolChoiceError, match="cannot be combined") as err:
        forced.sampling_params(SamplingParams(structured_outputs=SimpleNamespace()))
    assert err.value.param == "tool_choice"


def test_the_policies_differ_only_where_they_should():
    """The server needs --enable-auto-tool-choice for "auto"; the offline API reads "auto"
    with its tool_parser (default hermes) and refuses an unknown one."""
    with pytest.raises(InvalidRequestError, match="enable-auto-tool-choice"):
        _server("auto", auto=False)
    plan, _ = _server("required", auto=False)               # forced: hermes by default
    assert plan.parser_name == "hermes" and plan.constraint is not None
    _, offline = plan_offline_tools([WEATHER], None, None, True, None)
    assert (offline.choice, offline.parser_name) == ("auto", "hermes")
    with pytest.raises(InvalidRequestError, match="tool_parser"):
        plan_offline_tools([WEATHER], None, "nope", True, None)
    with pytest.raises(ToolChoiceError, match="not in tools"):
        plan_offline_tools([WEATHER], {"type": "function", "function": {"name": "x"}},
                           None, True, None)


CUT = TWO.replace('"Oslo"}}\n</tool_call>', '"Os')      # max_tokens ended the second call


def test_a_call_cut_in_half_is_left_out_of_the_reply():
    """The completed calls come back, the cut one does not (nor its text as content); a
    reply of only a cut call has neither content nor calls, so nothing fails to parse."""
    from iterserve.server.serving_tools import message_with_tools

    plan = plan_tool_choice([WEATHER, PING], "auto", parallel=True, auto_parser="hermes",
                            forced_format="hermes")
    parsed = plan.parser().extract(CUT)                 # the parser itself reports both
    assert [c.complete for c in parsed.tool_calls] == [True, False]
    ex = plan.extract(CUT)
    assert [c.name for c in ex.tool_calls] == ["ping"] and ex.dropped == 1
    message, called = message_with_tools(plan, CUT)
    assert called and message["content"] is None
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ["{}"]
    only_cut = CUT[CUT.index("<tool_call>\n{\"name\": \"get_weather\""):]
    message, called = message_with_tools(plan, "Checking.\n" + only_cut)
    assert not called and message == {"role": "assistant", "content": "Checking."}
    # arguments that are not a JSON object are not a call a client can run either
    bad = '<tool_call>\n{"name": "ping", "arguments": "not json"}\n</tool_call>'
    assert plan.extract(bad).tool_calls == [] and plan.extract(bad).dropped == 1
