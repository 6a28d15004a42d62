"""NDJSON as the service writes it (streams, the run log): one JSON value a line, lines ended by
"\n" alone.

Not `str.splitlines` nor httpx's `iter_lines`, which also end a line at U+2028, U+2029, U+0085 and
other Unicode line boundaries: JSON may carry those raw inside a string (orjson writes them so), and a
model's text does hold them, so a group's line would come apart in the middle of its JSON.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator


class LineSplitter:
    """Bytes as they arrive -> whole lines (decoded, without their "\\n" or a "\\r" before it). A line
    that comes in many chunks (a group is ~1 MB) is joined once, when its end comes."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []

    def feed(self, chunk: bytes) -> list[str]:
        if b"\n" not in chunk:
            if chunk:
                self._pending.append(chunk)
            return []
        self._pending.append(chunk)
        parts = b"".join(self._pending).split(b"\n")
        rest = parts.pop()
        self._pending = [rest] if rest else []
        return [_text(part) for part in parts]

    def end(self) -> list[str]:
        """What came after the last "\\n": a last line without one (or the part of a line cut off)."""
        rest, self._pending = b"".join(self._pending), []
        return [_text(rest)] if rest else []


def _text(line: bytes) -> str:
    return line.removesuffix(b"\r").decode("utf-8", "replace")


def lines(chunks: Iterable[bytes]) -> Iterator[str]:
    splitter = LineSplitter()
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.end()


async def alines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    splitter = LineSplitter()
    async for chunk in chunks:
        for line in splitter.feed(chunk):
            yield line
    for line in splitter.end():
        yield line


def split(text: str) -> list[str]:
    """A whole NDJSON text's lines (a file read at once)."""
    return [line.removesuffix("\r") for line in text.split("\n")]
