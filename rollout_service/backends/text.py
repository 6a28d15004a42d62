"""Text made encodable, for both sides of the wire: the service's model client (rollout_service/backends/transport.py)
and refenv (refenv/text.py). Standard library only, so refenv imports it without the service's
HTTP stack."""

from __future__ import annotations

from typing import Any


def clean_text(value: Any) -> Any:
    """`value` with every string made encodable: a lone UTF-16 surrogate (legal in JSON escapes,
    illegal in UTF-8) becomes U+FFFD, in nested lists and dicts too. Text that came in this way
    would otherwise fail the next request, or the serialisation of a whole group, later."""
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
