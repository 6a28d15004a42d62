"""The support model: refenv answers the responder stage itself from an OpenAI-compatible server."""

from __future__ import annotations

import httpx

from refenv.agent import Reply
from refenv.episodes import SupportModelError
from refenv.text import clean_text


class SupportModel:
    """`--support-model URL,NAME`: an Ask that calls `URL/v1/chat/completions` with model NAME."""

    def __init__(self, spec: str, timeout_s: float = 120.0) -> None:
        url, sep, name = spec.partition(",")
        if not sep or not url or not name:
            raise ValueError("--support-model takes URL,NAME (e.g. http://127.0.0.1:8000,my-model)")
        self.base_url = url.rstrip("/").removesuffix("/v1")
        self.model = name
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def __call__(self, observation: dict) -> Reply:
        body: dict = {"model": self.model, "messages": observation["messages"], "temperature": 0.0, "max_tokens": 128}
        try:
            response = await self._client.post(f"{self.base_url}/v1/chat/completions", json=body)
            response.raise_for_status()
            data = clean_text(response.json())  # its text is echoed and run like a driver's completion
            text = data["choices"][0]["message"]["content"] or ""
            usage = data.get("usage") or {}
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise SupportModelError(f"support model call failed: {type(exc).__name__}: {exc}") from None
        return Reply(text, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))

    async def aclose(self) -> None:
        await self._client.aclose()
