"""The run viewer: pages in the browser over a live service (`/ui`) or a run log (`rollout-service view`).

Read-only. The page and its assets ship in this package (static/): nothing loads from elsewhere.
"""

from __future__ import annotations

from fastapi import FastAPI

from .live import LiveBook, hook
from .routes import SecurityHeaders, router

__all__ = ["SecurityHeaders", "attach_viewer"]


def attach_viewer(app: FastAPI) -> None:
    """The viewer on the service's app: its routes and its book of recent groups. Its headers
    (SecurityHeaders) go outside every other middleware, so refusals (401, 403) carry them too."""
    book = LiveBook(app.state.service)
    app.state.viewer = book
    hook(app, book)
    # The routes themselves, not the router: PlaneAuth matches the app's own route list (see http/app.py).
    app.router.routes.extend(router.routes)
