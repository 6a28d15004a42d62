"""Text from clients and models made encodable before refenv keeps or echoes any of it."""

from __future__ import annotations

import json
from typing import Any

from rollout_service.backends.text import clean_text  # the service's own: one reading of a completion on both sides

__all__ = ["clean_text", "loads_clean"]


def loads_clean(text: str | bytes) -> Any:
    """`json.loads(text)` with its strings cleaned; raises what `json.loads` raises."""
    return clean_text(json.loads(text))
