"""Tool calls in the Hermes/Qwen convention: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
in a model's sampled text, read into OpenAI's `tool_calls`; and the same convention written for a
chat template that has no tool support of its own (tools in the system message, results as turns).

Parsing never drops text: a block that is not a call (broken JSON, no name) stays in the content and
is counted, so the caller can say how many it could not read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


@dataclass
class ParsedText:
    """A completion's text read for tool calls: the calls (name, arguments as a JSON string), the text
    left as content (None when nothing but calls), and how many blocks could not be read."""

    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)
    unparsed: int = 0


def parse_tool_calls(text: str) -> ParsedText:
    """The calls in `text`. An unclosed `<tool_call>` (cut by max_tokens) and a block whose JSON is
    not an object with a string `name` stay in the content, counted as unparsed."""
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    at = 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue  # left where it is: the kept text runs through it
        kept.append(text[at : match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    unparsed = text.count(_OPEN) - len(calls)  # every block opens with the tag, read or not
    if not calls:
        return ParsedText(text, [], unparsed)
    return ParsedText("".join(kept).strip() or None, calls, unparsed)


def _call(body: str) -> tuple[str, str] | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # already a JSON string, as OpenAI's wire form has it
        return data["name"], arguments
    return data["name"], json.dumps(arguments, ensure_ascii=False)


def render_tool_call(name: str, arguments: str) -> str:
    """A call as the model would write it: how an assistant message the model did not sample (one the
    agent wrote itself) is put in the conversation."""
    try:
        parsed: Any = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = arguments  # not JSON: kept as the string it is
    return f"{_OPEN}\n{json.dumps({'name': name, 'arguments': parsed}, ensure_ascii=False)}\n</tool_call>"


def tools_instruction(tools: list[dict[str, Any]]) -> str:
    """The tools as Hermes-style templates put them in the system message."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False, sort_keys=True) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def tool_result(content: str) -> str:
    """A tool's result as Hermes-style templates put it in a user turn."""
    return f"<tool_response>\n{content}\n</tool_response>"
