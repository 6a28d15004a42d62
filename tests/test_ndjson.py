"""rollout_service/ndjson.py's line splitter against bytes.split(b"\\n") of the whole text, over every
way of cutting the text into three chunks (inside a multi-byte character, between "\\r" and "\\n",
empty chunks). Break tried: splitting with str.splitlines -> the U+2028 line comes apart, fails."""

from __future__ import annotations

import asyncio

from rollout_service import ndjson

TEXT = 'é\u2028z\r\n{"a": "\u0085"}\n\nlast'.encode()
WANT = [part.removesuffix(b"\r").decode() for part in TEXT.split(b"\n")]


def test_every_cut_of_the_text_gives_its_lines():
    for one in range(len(TEXT) + 1):
        for two in range(one, len(TEXT) + 1):
            chunks = [TEXT[:one], b"", TEXT[one:two], TEXT[two:]]
            assert list(ndjson.lines(chunks)) == WANT, (one, two)


def test_the_async_reader_and_a_text_read_at_once_agree():
    async def chunks():
        for i in range(0, len(TEXT), 3):
            yield TEXT[i : i + 3]

    async def read() -> list[str]:
        return [line async for line in ndjson.alines(chunks())]

    assert asyncio.run(read()) == WANT
    assert ndjson.split(TEXT.decode()) == WANT
    assert list(ndjson.lines([TEXT + b"\n"])) == WANT  # a last "\n" adds no empty line
