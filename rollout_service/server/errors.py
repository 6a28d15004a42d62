"""What the service answers when it cannot do what was asked."""

from __future__ import annotations


class StartupError(Exception):
    """The service cannot start as configured; the message says what to fix."""


class IncomparableEnv(StartupError):
    """An env serves a task that another env serves with another dataset or reward version."""


class RequestRefused(Exception):
    """A trainer's request cannot be served as sent: HTTP status, code, what to change, extra headers."""

    def __init__(self, status: int, error: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.error, self.message, self.headers = status, error, message, headers or {}


def shutting_down() -> RequestRefused:
    return RequestRefused(
        503,
        "shutting_down",
        "the service is shutting down; this group's episodes were abandoned "
        "and its worlds given back. Send it again to a running service",
    )
