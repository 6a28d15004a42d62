"""An agent's OpenAI messages as the chat template's plain messages (role, text content).

Three things are done so that the render is what the model saw and what it sampled:
- an assistant message the service returned (matched by its content and tool calls: ids, names and
  arguments, the arguments compared as JSON) is put back as the text the model sampled, tool call
  tags and all, so the trajectory goes on from the sampled tokens instead of a re-render of the
  parsed call; one whose calls the agent changed is rendered as the agent sent it;
- `tools` go into the system message, and `tool` results into user turns, in the Hermes convention
  (backends/tool_calls.py), for a template without tool support of its own;
- content given as parts is joined to its text; other parts (images) are refused.
"""

from __future__ import annotations

import json
from typing import Any

from ...backends.tool_calls import render_tool_call, tool_result, tools_instruction
from .sessions import AgentRefused

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

ReturnedKey = tuple[str, tuple[tuple[str, str, str], ...]]


def returned_key(content: str | None, calls: list[tuple[str, str, str]]) -> ReturnedKey:
    """How an assistant message the service returned is known again when the agent sends it back: its
    content and its calls (id, name, arguments). Arguments changed by the agent make it another message
    (rendered as sent), the same arguments re-serialized (spacing, key order) do not."""
    return (content or "", tuple((call_id, name, _canonical(arguments)) for call_id, name, arguments in calls))


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        return arguments  # not JSON: compared as the text it is


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined; AgentRefused for anything else."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise AgentRefused(400, "invalid_request", f"{where}: only text content parts are served")
            texts.append(part["text"])
        return "".join(texts)
    raise AgentRefused(400, "invalid_request", f"{where}: content must be a string or a list of text parts")


def _calls_of(message: dict[str, Any], where: str) -> list[tuple[str, str, str]]:
    """An assistant message's tool calls as (id, name, arguments)."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise AgentRefused(400, "invalid_request", f"{where}: tool_calls must be a list")
    read = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise AgentRefused(400, "invalid_request", f"{where}: a tool call without function.name")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):  # an object where OpenAI's wire form has its JSON string
            arguments = "" if arguments is None else json.dumps(arguments, ensure_ascii=False)
        read.append((str(call.get("id", "")), function["name"], arguments))
    return read


def template_messages(
    messages: list[Any], tools: list[dict[str, Any]] | None, returned: dict[ReturnedKey, str]
) -> list[dict[str, str]]:
    """The messages to render: plain role/content pairs the template takes (module docstring)."""
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            roles = ", ".join(_ROLES)
            raise AgentRefused(400, "invalid_request", f"{where}: a message is an object with a role ({roles})")
        role = _ROLES[message["role"]]
        text = text_of(message.get("content"), where)
        if role == "assistant":
            calls = _calls_of(message, where)
            sampled = returned.get(returned_key(text, calls))
            if sampled is None:  # written by the agent itself: as the model would have written it
                sampled = "\n".join([text, *(render_tool_call(name, args) for _, name, args in calls)]).strip("\n")
            out.append({"role": "assistant", "content": sampled})
        elif role == "tool":
            out.append({"role": "user", "content": tool_result(text)})
        else:
            out.append({"role": role, "content": text})
    if tools:
        instruction = tools_instruction(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{instruction}".lstrip("\n")}
        else:
            out.insert(0, {"role": "system", "content": instruction})
    return out
