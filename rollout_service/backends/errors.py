"""Why a completion could not be had: the typed errors of the model-server side."""

from __future__ import annotations

import re
from typing import ClassVar

from .transport import HttpAnswer

MAX_DETAIL_CHARS = 500


class InferenceError(Exception):
    """A completion could not be had. Subclasses say why; `kind` names it in results, `detail` is
    the server's words (bounded), `status` its HTTP status where it answered."""

    kind: ClassVar[str] = "inference_server_error"
    # A failure of this server, not of the request: another replica may succeed.
    replica_down: ClassVar[bool] = False

    def __init__(self, detail: str = "", status: int | None = None) -> None:
        self.detail, self.status = detail[:MAX_DETAIL_CHARS], status
        super().__init__(f"{self.kind}: {self.detail}" if detail else self.kind)


class InferenceTimeout(InferenceError):
    """No answer within the client's deadline (--inference-timeout)."""

    kind = "inference_timeout"


class InferenceUnreachable(InferenceError):
    """The server could not be reached, or dropped the connection."""

    kind = "inference_unreachable"
    replica_down = True


class AddressNotAllowed(InferenceUnreachable):
    """The server's name resolves now to an address the service may not reach (--allow-backends):
    not connected to."""


class InferenceServerError(InferenceError):
    """The server answered 5xx."""

    kind = "inference_server_error"
    replica_down = True


class InferenceRejected(InferenceError):
    """The server refused the request (4xx)."""

    kind = "inference_rejected"


class ContextOverflow(InferenceRejected):
    """The prompt (plus max_tokens) does not fit the model's context window: the conversation the
    policy produced outgrew it."""

    kind = "context_overflow"


class InferenceAnswerTooLarge(InferenceError):
    """An answer longer than --max-answer-bytes, cut off as it came (a server's bug, or not ours)."""

    kind = "inference_answer_too_large"


class BadInferenceResponse(InferenceError):
    """A 2xx answer the client cannot use: no choices, wrong shape."""

    kind = "bad_response"


class WeightUpdateError(Exception):
    """A model server did not change what it serves as asked (an adapter, its weights, a pause);
    `status` is its HTTP status where it answered. `refused` (4xx) means it judged the request wrong
    (a bad path), not that it is unwell."""

    def __init__(self, url: str, action: str, detail: str, status: int | None = None) -> None:
        self.url, self.action, self.status = url, action, status
        self.detail = detail[:MAX_DETAIL_CHARS]
        super().__init__(f"{action} on {url}: {self.detail}")

    @property
    def refused(self) -> bool:
        return self.status is not None and 400 <= self.status < 500


# A 4xx whose words say the prompt did not fit the model's context window.
CONTEXT_OVERFLOW = re.compile(r"maximum context length|context length|context window|too many tokens", re.I)


def error_text(response: HttpAnswer) -> str:
    """The server's own words for an error answer: its JSON error message, else its text."""
    try:
        data = response.json()
        if isinstance(data, dict):
            err = data.get("error", data.get("detail", data))
            if isinstance(err, dict):
                return str(err.get("message", err))
            return str(err)
    except ValueError:
        pass
    return response.text
