"""What the service answers when it cannot do what was asked: one exception per kind of refusal.

The rooms raise these; `http/app.py` maps each kind to its HTTP status in one table (`HTTP_STATUS`), and
every refusal is answered with the same JSON body: `{"error": code, "message": what to change}`.
"""

from __future__ import annotations


class StartupError(Exception):
    """The service cannot start as configured; the message says what to fix."""


class IncomparableEnv(StartupError):
    """An env serves a task that another env serves with another dataset or reward version."""


class RequestRefused(Exception):
    """A request cannot be served as sent: a code a program can test, what to change, and (for a
    refusal that time may lift) how many seconds to wait before asking again."""

    def __init__(self, error: str, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.error, self.message, self.retry_after_s = error, message, retry_after_s


class NotFound(RequestRefused):
    """It names a task, env, replica or model this service does not have."""


class Conflict(RequestRefused):
    """It clashes with the service's state (present already, busy, draining, paused)."""


class Invalid(RequestRefused):
    """It is well formed but cannot be served as asked (over a limit, refused by a backend's check)."""


class TooBusy(RequestRefused):
    """The service is full for now: send it again later (Retry-After)."""


class Unavailable(RequestRefused):
    """The service cannot serve it now (starting, shutting down, every env draining)."""


class Gone(RequestRefused):
    """It names something this service had and no longer has (a sampler stream deleted or expired)."""


class BackendFailed(RequestRefused):
    """A backend asked on the request's behalf failed (a policy update no replica took)."""


class BackendTimedOut(RequestRefused):
    """A backend did not answer within the request's timeout_s."""


def shutting_down() -> Unavailable:
    return Unavailable(
        "shutting_down",
        "the service is shutting down; this group's episodes were abandoned "
        "and its worlds given back. Send it again to a running service",
    )
