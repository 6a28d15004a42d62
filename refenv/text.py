"""Text from clients and models made encodable before refenv keeps or echoes any of it."""

from __future__ import annotations

import json
from typing import Any


def clean_text(value: Any) -> Any:
    """`value` with each lone UTF-16 surrogate in its strings (nested lists and dicts too) made U+FFFD.

    JSON's `\\ud800` escapes decode to such code points, which UTF-8 cannot encode: kept, they fail
    every later answer that echoes them (a completion is in every later observation's messages) and
    every SQLite statement that holds them. A model can emit them, so they are replaced, not refused.
    The rollout service does the same in inference/transport.py; this copy keeps refenv importable
    without the service's HTTP stack (aiohttp, orjson)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")  # one U+FFFD each
    if isinstance(value, list):
        return [clean_text(v) for v in value]
    if isinstance(value, dict):
        return {clean_text(k): clean_text(v) for k, v in value.items()}
    return value


def loads_clean(text: str | bytes) -> Any:
    """`json.loads(text)` with its strings cleaned; raises what `json.loads` raises."""
    return clean_text(json.loads(text))
