"""The service's logging: the root level and a text or JSON line format, set once at start."""

from __future__ import annotations

import json
import logging
import time

TEXT_FORMAT = "%(asctime)s [rollout-service] %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: what log collectors parse without a pattern of their own."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, fmt: str = "text") -> None:
    """Set the root logger's level and its one handler (stderr); uvicorn's loggers propagate to it."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # httpx logs every request at info: a line per env step and model call, below debug only noise.
    logging.getLogger("httpx").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
