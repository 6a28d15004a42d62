"""Bodies as JSON, fast: orjson encodes and decodes, the standard library takes what orjson refuses.

orjson encodes; a body it refuses (a lone UTF-16 surrogate in a string) is encoded by the standard
library instead, escaped as JSON allows. Answers are decoded by orjson, or by the standard library
where orjson refuses them (a surrogate escape), so `loads` gives what `json` would. Two differences
from `json` remain, neither reachable with token ids and the models' bounded sampling parameters:
orjson writes NaN and infinities as null, and reads integers over 64 bits as floats. A JsonList in a
body is sent as the JSON it kept (see there).
"""

from __future__ import annotations

import json as std_json
from typing import Any

import orjson


class JsonList(list):
    """A list that keeps its own JSON as it grows: an exact attempt's prompt is thousands of ids, sent
    once a turn and written again in the group's result, and serialising them again each time took ~9%
    of the service's CPU at bench/ceiling.py's ceiling.
    Appended to with `grow` and `repeat` (which write the new items' JSON once); copies share what was
    written.

    A list changed with list methods is written as a plain list (each of them marks it so) until its
    next `grow` or `repeat`, which writes its JSON again. Anything that reads a list can read one."""

    __slots__ = ("_body", "_upto", "_count")

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self._body = bytearray(_dump_items(self))  # items and their commas; only ever appended to
        self._upto = len(self._body)
        self._count = len(self)  # -1 once changed with a list method: the JSON no longer holds

    def grow(self, items: list) -> None:
        """`items` appended; their JSON is written here, or taken from a JsonList that has it."""
        written = items._items_json() if isinstance(items, JsonList) else None
        self._written(written if written is not None else _dump_items(items), items)

    def repeat(self, item: int | None, times: int) -> None:
        """`times` more of `item` (0, 1 or None)."""
        self._written(((orjson.dumps(item) + b",") * times)[:-1], [item] * times)

    def snapshot(self) -> JsonList:
        """A copy of the list as it is now, sharing the JSON (later growth of this list is not in it)."""
        copy = JsonList.__new__(JsonList)
        list.extend(copy, list.copy(self))  # from a plain list: a subclass would be copied item by item
        copy._body, copy._upto, copy._count = self._body, self._upto, self._count
        return copy

    def json(self) -> orjson.Fragment | None:
        """The list's JSON for orjson to copy as it is; None when the list has changed since."""
        if len(self) != self._count:
            return None
        # Joined from a view: the items' JSON copied once, not twice.
        with memoryview(self._body) as body, body[: self._upto] as items:
            return orjson.Fragment(b"".join((b"[", items, b"]")))

    def _items_json(self) -> bytearray | None:
        """The JSON of the items without the brackets (a copy); None when the list has changed since."""
        return self._body[: self._upto] if len(self) == self._count else None

    def _written(self, part: bytes | bytearray, items: list) -> None:
        if len(self) != self._count:  # changed with list methods: written again
            self._body = bytearray(_dump_items(list(self)))
            self._upto = len(self._body)
        elif self._upto != len(self._body):
            # The body is shared (with the list this one is a snapshot of, or another snapshot) and
            # holds more than this list: from here on this list writes a body of its own.
            self._body = self._body[: self._upto]
        if part:
            if self._upto:
                self._body += b","
            self._body += part
            self._upto = len(self._body)
        list.extend(self, items)
        self._count = len(self)

    def _changed(self) -> None:
        self._count = -1

    def __setitem__(self, index: Any, value: Any) -> None:
        list.__setitem__(self, index, value)
        self._changed()

    def __delitem__(self, index: Any) -> None:
        list.__delitem__(self, index)
        self._changed()

    def __iadd__(self, items: Any) -> JsonList:  # type: ignore[misc]
        list.extend(self, items)
        self._changed()
        return self

    def __imul__(self, times: Any) -> JsonList:  # type: ignore[misc]
        list.__imul__(self, times)
        self._changed()
        return self

    def append(self, item: Any) -> None:
        list.append(self, item)
        self._changed()

    def extend(self, items: Any) -> None:
        list.extend(self, items)
        self._changed()

    def insert(self, index: Any, item: Any) -> None:
        list.insert(self, index, item)
        self._changed()

    def pop(self, index: Any = -1) -> Any:
        item = list.pop(self, index)
        self._changed()
        return item

    def remove(self, item: Any) -> None:
        list.remove(self, item)
        self._changed()

    def clear(self) -> None:
        list.clear(self)
        self._changed()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        list.sort(self, *args, **kwargs)
        self._changed()

    def reverse(self) -> None:
        list.reverse(self)
        self._changed()


def _dump_items(items: list) -> bytes:
    """`items` as JSON without the brackets: orjson's, or the standard library's for what orjson
    refuses (an int over 64 bits)."""
    try:
        return orjson.dumps(items)[1:-1]
    except TypeError:
        return std_json.dumps(items, separators=(",", ":")).encode()[1:-1]


def plain_json(value: Any) -> Any:
    """orjson's `default` with OPT_PASSTHROUGH_SUBCLASS: a JsonList's own JSON; other subclasses of
    what JSON knows as what they are JSON of."""
    if isinstance(value, JsonList):
        written = value.json()
        return written if written is not None else list(value)
    if isinstance(value, str):
        return str.__str__(value)  # a str enum's value, not its name
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, list | dict):
        return list(value) if isinstance(value, list) else dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value, default=plain_json, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
    except TypeError:  # a lone surrogate (orjson refuses it), or a type only `json` knows
        return std_json.dumps(value).encode()


def loads(body: bytes | str) -> Any:
    """`body` as JSON; ValueError when it is not JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return std_json.loads(body)  # a surrogate escape orjson will not take; raises ValueError if not JSON
