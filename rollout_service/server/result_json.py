"""A group's result as the JSON every consumer gets (the stream, `POST /groups`, the run log).

A group of exact 4-turn attempts holds ~100k token ids and logprobs, and pydantic's serialiser took
~19% of the service's CPU at bench/ceiling.py's ceiling. orjson writes the same JSON ~3x faster:
each model's fields under their aliases, as `model_dump_json(by_alias=True)` would (checked byte
for byte in tests/test_trajectory.py), and pydantic itself writes whatever orjson cannot (say, an
int over 64 bits). Here, not in the protocol, because a trainer installs no orjson.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel

from ..protocol import GroupResult

# Per model class: (attribute, JSON key) of each field pydantic serialises.
_SERIALISED: dict[type[BaseModel], tuple[tuple[str, str], ...]] = {}


def group_json(result: GroupResult) -> str:
    try:
        return orjson.dumps(result, default=_fields_by_alias).decode()
    except TypeError:
        return result.model_dump_json(by_alias=True)


def _fields_by_alias(value: Any) -> dict[str, Any]:
    if not isinstance(value, BaseModel):
        raise TypeError(f"{type(value).__name__} is not JSON")
    cls = type(value)
    keys = _SERIALISED.get(cls)
    if keys is None:
        keys = _SERIALISED[cls] = tuple(
            (name, info.serialization_alias or info.alias or name)
            for name, info in cls.model_fields.items()
            if not info.exclude
        )
    return {key: getattr(value, name) for name, key in keys}  # no result model takes extra fields
