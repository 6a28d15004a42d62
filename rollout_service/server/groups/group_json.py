"""A group's result as the JSON every consumer gets (the stream, `POST /groups`, the run log).

A group of exact 4-turn attempts holds ~100k token ids and logprobs, and pydantic's serialiser took
~19% of the service's CPU at bench/ceiling.py's ceiling. orjson writes the same JSON ~3x faster:
each model's fields under their aliases, as `model_dump_json(by_alias=True)` would (checked byte
for byte in tests/test_trajectory.py and tests/test_group_outcome.py, but for the line breaks
`one_line` escapes), and pydantic itself writes whatever orjson cannot (say, an int over 64 bits).
Here, not in the protocol, because a trainer installs no orjson.

Most of a group is its trajectories' arrays and its turns' ids and messages. The arrays and ids
the service builds are JsonLists (rollout_service/backends/json_body.py), which kept their JSON as they grew: they
are copied into the result as written, not serialised again (serialising them again costs ~9% of the
service's CPU at the ceiling). Bytes, not str: the stream and the run log send them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel

from ...backends.json_body import plain_json
from ...protocol import GroupResult

# Per model class: (attribute, JSON key) of each field pydantic serialises; None where every field is
# serialised under its own name: the instance's __dict__ is written as it is (no result model has a
# cached_property, which would sit there too).
_SERIALISED: dict[type[BaseModel], tuple[tuple[str, str], ...] | None] = {}


# Characters JSON may carry raw in a string, as orjson and pydantic write them, that many line readers
# (str.splitlines, httpx's iter_lines, requests') also take as the end of a line; a model's text does
# hold them. In a stream or the run log each is written as its escape, the same JSON string, so that a
# group's line stays one line for every reader: U+0085, U+2028, U+2029 in UTF-8. (The other such
# characters are below U+0020, which JSON always escapes.)
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def one_line(body: bytes) -> bytes:
    """JSON as written, with no byte sequence a line reader could split it at (see _LINE_BREAKS)."""
    # A lone byte is found at memchr's speed (~0.02 ms a MB), a sequence of three at ~1 ms a MB: most
    # groups hold neither lead byte (ids, logprobs, ASCII text) and are not searched further.
    if b"\xc2" not in body and b"\xe2" not in body:
        return body
    for raw, escaped in _LINE_BREAKS:
        if raw in body:  # in valid UTF-8 these bytes are only ever that character
            body = body.replace(raw, escaped)
    return body


def group_line(head: bytes, body: bytes) -> bytes:
    """A stream's line for a group: `head` (the line's JSON up to the group, `{"index": 3, "group": `),
    the group's JSON `body`, the closing brace and the line's end. Joined: bytes' %-formatting copied
    a 1 MB group ~25x slower (~0.6 ms a group)."""
    return b"".join((head, body, b"}\n"))


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """A finished group as Admission hands it on: the typed result for the service's own readers (the
    sampler's filter, the measuring tool) and its JSON for those outside, encoded once, so that no
    reader parses back what the service wrote."""

    result: GroupResult
    body: bytes  # group_json(result)

    @classmethod
    def of(cls, result: GroupResult) -> GroupOutcome:
        return cls(result, group_json(result))


def group_json(result: GroupResult) -> bytes:
    try:
        body = orjson.dumps(result, default=_fields_by_alias, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
    except TypeError:
        body = result.model_dump_json(by_alias=True).encode()
    return one_line(body)


def _fields_by_alias(value: Any) -> Any:
    if not isinstance(value, BaseModel):
        return plain_json(value)  # a JsonList (an exact turn's lists, a trajectory's arrays) as written
    cls = type(value)
    if cls not in _SERIALISED:
        named = tuple(
            (name, info.serialization_alias or info.alias or name)
            for name, info in cls.model_fields.items()
            if not info.exclude
        )
        same = all(name == key for name, key in named) and len(named) == len(cls.model_fields)
        _SERIALISED[cls] = None if same else named
    keys = _SERIALISED[cls]
    if keys is None:
        # A model's fields, in their order, and nothing else (private attributes and extra fields are
        # kept elsewhere; no result model takes extra fields).
        return value.__dict__
    return {key: getattr(value, name) for name, key in keys}
