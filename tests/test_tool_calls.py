"""Tool calls read from sampled text (rollout_service/backends/tool_calls.py) and the messages an
agent sends rendered for a template without tool support (server/agents/messages.py). Pure
functions, checked against hand-written expectations."""

from __future__ import annotations

import json

import pytest

from rollout_service.backends.tool_calls import parse_tool_calls, render_tool_call
from rollout_service.server.agents.messages import returned_key, template_messages
from rollout_service.server.agents.sessions import AgentRefused


def test_calls_are_read_and_text_around_them_kept():
    """Break tried: `_call` refusing `arguments` given as a JSON string -> the second call is unparsed."""
    text = 'Let me look.\n<tool_call>{"name": "run_sql", "arguments": {"q": "select 1"}}</tool_call>\n' \
        '<tool_call>{"name": "submit", "arguments": "{\\"answer\\": \\"1\\"}"}</tool_call>'  # fmt: skip
    parsed = parse_tool_calls(text)
    assert parsed.calls == [("run_sql", '{"q": "select 1"}'), ("submit", '{"answer": "1"}')]
    assert parsed.content == "Let me look." and parsed.unparsed == 0


def test_what_cannot_be_read_is_returned_as_text_and_counted():
    """A broken block, one without a name, and one cut by max_tokens: never dropped, each counted.
    Break tried: unparsed counted as the blocks that failed to decode only -> the unclosed one is not
    counted (2, not 3)."""
    text = '<tool_call>{"name": oops}</tool_call> <tool_call>{"arguments": {}}</tool_call> <tool_call>{"name": "a"'
    parsed = parse_tool_calls(text)
    assert parsed.calls == [] and parsed.content == text and parsed.unparsed == 3
    mixed = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>nope</tool_call>')
    assert mixed.calls == [("a", "{}")] and mixed.content == "<tool_call>nope</tool_call>" and mixed.unparsed == 1


def test_messages_are_rendered_in_the_hermes_convention_and_returned_turns_put_back_as_sampled():
    """Tools into the system message, tool results as user turns, a returned assistant message back as
    its sampled text, one the agent wrote itself as the model would have written it.
    Break tried: the returned message looked up without its tool call ids -> rendered from the parsed
    call (`render_tool_call`), not the sampled text."""
    sampled = '<tool_call>{"name":"list_tables","arguments":{}}</tool_call>'
    returned = {returned_key(None, [("call_1", "list_tables", "{}")]): sampled}
    tools = [{"type": "function", "function": {"name": "list_tables", "parameters": {}}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Which "}, {"type": "text", "text": "tables?"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "list_tables", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "users"},
        {"role": "assistant", "content": "Done.",
         "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "submit", "arguments": '{"a": 1}'}}]},
    ]  # fmt: skip
    out = template_messages(messages, tools, returned)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert "<tools>" in out[0]["content"] and json.dumps(tools[0], sort_keys=True) in out[0]["content"]
    assert out[1]["content"] == "Which tables?"
    assert out[2]["content"] == sampled
    assert out[3]["content"] == "<tool_response>\nusers\n</tool_response>"
    assert out[4]["content"] == "Done.\n" + render_tool_call("submit", '{"a": 1}')
    for bad in ([{"role": "wizard", "content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        with pytest.raises(AgentRefused) as refused:
            template_messages(bad, None, {})
        assert refused.value.status == 400
