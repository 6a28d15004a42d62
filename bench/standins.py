"""Instant stand-ins for the ceiling benchmark: a model server and an env that answer at once.

They exist so that the service is the only thing being measured (bench/ceiling.py): a real vLLM
or env would be the bottleneck long before the service is. Each runs in its own process on a
bare asyncio protocol (httptools parses, orjson encodes), so a request costs them a few tens of
microseconds; bench/ceiling.py reports their CPU next to the service's to show they are not the
limit.

    python bench/standins.py model --port 18100 --completion-tokens 128
    python bench/standins.py env --port 0 --port-file env.port --pool 256 --turns 4 --prompt-tokens 2000

`--port 0` binds a port the system picks, and `--port-file PATH` receives the port once the server
listens (rollout_service/listening.py's format, as the service and refenv write it): a launcher reads
it back (ManagedProcess.wait_port) instead of choosing a free port for the stand-in.

The model server speaks what the service uses of vLLM: /v1/models, /tokenize (messages through a
ChatML-like template whose render of a conversation is the concatenation of its messages' renders,
so exact trajectories work; a completion's text renders as its sampled ids, or --replies otherwise), and
/v1/completions with token prompts (N tokens with their logprobs, as "token_id:<id>" where asked;
the ids and the prompt's with return_token_ids) and /v1/chat/completions. A "token" is 4 characters.

The env speaks the step contract: /health, /tasks, /step/reset, /step and DELETE /step/{id}, with
multi-turn episodes whose messages grow by the completion and an observation each turn. Its own
counters (GET /stats: episodes open now and at most, steps, and each step's turnaround: from its
answer to the episode's next request) are the benchmark's oracle.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import httptools
import orjson
import uvloop

from rollout_service.listening import write_port_file

MODEL = "ceiling-model"
CHARS_PER_TOKEN = 4
START, END, NL = 1, 2, 3
ROLE = {"system": 10, "user": 11, "assistant": 12, "tool": 13}

Handler = Callable[[str, str, bytes], tuple[int, bytes]]


class _Http(asyncio.Protocol):
    """HTTP/1.1 keep-alive with Content-Length bodies: all that httpx sends."""

    def __init__(self, handle: Handler) -> None:
        self.handle = handle
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        path = self.url.decode().split("?", 1)[0]
        body = b"".join(self.body)
        self.url, self.body = b"", []
        try:
            status, payload = self.handle(method, path, body)
        except Exception as exc:  # a stand-in's bug must show, not hang the client
            status, payload = 500, orjson.dumps({"error": "standin_error", "message": repr(exc)})
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, len(payload), payload)
        )


def _serve(handle: Handler, port: int, port_file: Path | None = None) -> None:
    """Serve `handle` on loopback `port` (0: one the system picks), writing the port bound to
    `port_file` once listening."""

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(lambda: _Http(handle), "127.0.0.1", port, backlog=4096)
        if port_file is not None:
            write_port_file(port_file, server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    uvloop.run(main())


# -- the model server ---------------------------------------------------------------------------


# How the template tokenizes a completion's text, which decides how the service finds the env's new
# tokens in exact mode: as the ids sampled; otherwise, but as the text alone; otherwise than either.
REPLIES = ("as-sampled", "alone", "apart")


class Model:
    def __init__(self, completion_tokens: int, replies: str = "as-sampled") -> None:
        self.replies = replies
        n = completion_tokens
        self.ids = list(range(1000, 1000 + n))
        self.ids_json = orjson.dumps(self.ids)
        self.logprobs_json = orjson.dumps([-0.25] * n)
        self.chat_logprobs_json = orjson.dumps({"content": [{"token": "x", "logprob": -0.25}] * n})
        self.text = ("w" * (CHARS_PER_TOKEN - 1) + " ") * n
        self.text_json = orjson.dumps(self.text)
        self.tokens_json = orjson.dumps([f"token_id:{i}" for i in self.ids])  # return_tokens_as_token_ids
        self.text_tokens = orjson.dumps(["w" * (CHARS_PER_TOKEN - 1) + " "] * n)
        self.n = n
        self._content: dict[str, list[int]] = {}

    def content_ids(self, text: str) -> list[int]:
        if text == self.text and self.replies == "as-sampled":
            return self.ids
        ids = self._content.get(text)
        if ids is None:
            if len(self._content) > 100_000:
                self._content.clear()
            seed = zlib.crc32(text.encode())
            ids = [100 + (seed + i * 7919) % 40000 for i in range(max(1, len(text) // CHARS_PER_TOKEN))]
            self._content[text] = ids
        return ids

    def render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        out: list[int] = []
        for m in messages:
            out += (START, ROLE.get(m.get("role"), 14))
            content = self.content_ids(m.get("content") or "")
            if self.replies == "apart" and m.get("role") == "assistant" and len(content) > 8:
                content = [*content[:-1], 7]  # a long reply's last token joined with what follows it
            out += content
            out += (END, NL)
        if generation_prompt:
            out += (START, ROLE["assistant"])
        return out

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if path == "/v1/completions":
            request = orjson.loads(body)
            prompt = request["prompt"]
            ids = b""
            if request.get("return_token_ids"):
                ids = b"".join((b',"token_ids":', self.ids_json, b',"prompt_token_ids":', orjson.dumps(prompt)))
            tokens = self.tokens_json if request.get("return_tokens_as_token_ids") else self.text_tokens
            return 200, b"".join(
                (
                    b'{"id":"c","object":"text_completion","model":"%s","choices":[{"index":0,"text":' % MODEL.encode(),
                    self.text_json,
                    ids,
                    b',"logprobs":{"tokens":',
                    tokens,
                    b',"token_logprobs":',
                    self.logprobs_json,
                    b'},"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":%d,'
                    b'"completion_tokens":%d}}' % (len(prompt), self.n),
                )
            )
        if path == "/tokenize":
            request = orjson.loads(body)
            if "messages" in request:
                tokens = self.render(request["messages"], request.get("add_generation_prompt", True))
            else:
                tokens = self.content_ids(request.get("prompt") or "")
            return 200, orjson.dumps({"count": len(tokens), "max_model_len": 1 << 20, "tokens": tokens})
        if path == "/v1/chat/completions":
            request = orjson.loads(body)
            prompt = self.render(request["messages"], True)
            return 200, b"".join(
                (
                    b'{"id":"c","object":"chat.completion","model":"%s","prompt_token_ids":' % MODEL.encode(),
                    orjson.dumps(prompt),
                    b',"choices":[{"index":0,"message":{"role":"assistant","content":',
                    self.text_json,
                    b'},"token_ids":',
                    self.ids_json,
                    b',"logprobs":',
                    self.chat_logprobs_json,
                    b',"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":%d,'
                    b'"completion_tokens":%d}}' % (len(prompt), self.n),
                )
            )
        if path == "/v1/models":
            return 200, orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        if path == "/health":
            return 200, b"{}"
        return 404, orjson.dumps({"error": {"message": f"no route {method} {path}"}})


# -- the env ------------------------------------------------------------------------------------


class Env:
    def __init__(self, pool: int, turns: int, prompt_tokens: int, observation_tokens: int) -> None:
        self.pool, self.turns = pool, turns
        self.system = ("s" * (CHARS_PER_TOKEN - 1) + " ") * prompt_tokens
        self.observation = ("o" * (CHARS_PER_TOKEN - 1) + " ") * observation_tokens
        self.episodes: dict[str, tuple[list[dict], float]] = {}  # id -> (messages, answered at)
        self.ids = itertools.count()
        self.refused = 0  # resets asked for with every world taken, since start (warm-up included)
        self.stats_reset()

    def stats_reset(self) -> None:
        self.max_open = len(self.episodes)
        self.resets = self.steps = self.finished = self.abandoned = 0
        self.turnaround: list[float] = []

    def _observation(self, episode_id: str, messages: list[dict]) -> bytes:
        self.episodes[episode_id] = (messages, time.monotonic())
        return orjson.dumps(
            {
                "episode_id": episode_id,
                "task_id": "t1",
                "slug": "ceiling",
                "done": False,
                "observation": {"stage": "executor", "messages": messages},
            }
        )

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if path == "/step" and method == "POST":
            request = orjson.loads(body)
            episode_id = request["episode_id"]
            episode = self.episodes.get(episode_id)
            if episode is None:
                return 410, b'{"error":"episode_not_found","message":"unknown episode"}'
            messages, answered = episode
            self.turnaround.append(time.monotonic() - answered)
            self.steps += 1
            messages = [*messages, {"role": "assistant", "content": request["completion"]}]
            if sum(m["role"] == "assistant" for m in messages) >= self.turns:
                del self.episodes[episode_id]
                self.finished += 1
                return 200, orjson.dumps(
                    {
                        "episode_id": episode_id,
                        "task_id": "t1",
                        "slug": "ceiling",
                        "done": True,
                        "status": "finished",
                        "answer": "a",
                        "pass": True,
                        "reward": 1.0,
                        "score": {"failure_category": "", "tokens": request.get("completion_tokens")},
                    }
                )
            return 200, self._observation(episode_id, [*messages, {"role": "user", "content": self.observation}])
        if path == "/step/reset":
            if len(self.episodes) >= self.pool:
                self.refused += 1
                return 503, b'{"error":"no_world_available","message":"pool full"}'
            self.resets += 1
            episode_id = f"e{next(self.ids)}"
            messages = [{"role": "system", "content": self.system}, {"role": "user", "content": "task t1"}]
            answer = self._observation(episode_id, messages)
            self.max_open = max(self.max_open, len(self.episodes))
            return 200, answer
        if path.startswith("/step/") and method == "DELETE":
            if self.episodes.pop(path.removeprefix("/step/"), None) is None:
                return 410, b'{"error":"episode_not_found","message":"unknown episode"}'
            self.abandoned += 1
            return 200, b'{"status":"abandoned"}'
        if path == "/health":
            return 200, orjson.dumps(
                {
                    "status": "ready",
                    "workers": self.pool,
                    "tasks": 1,
                    "dataset": {"name": "ceiling", "catalog_hash": "ceiling-1"},
                    "reward_version": "ceiling-1",
                    "reward_profile": "default",
                    "capabilities": {"pool": self.pool},
                }
            )
        if path == "/tasks":
            return 200, b'{"tasks":[{"task_id":"t1","slug":"ceiling","prompt":"task t1"}]}'
        if path == "/stats":
            turnaround = sorted(self.turnaround)
            answer = {
                "open": len(self.episodes),
                "max_open": self.max_open,
                "pool": self.pool,
                "resets": self.resets,
                "steps": self.steps,
                "finished": self.finished,
                "abandoned": self.abandoned,
                "refused": self.refused,
                "turnaround_p50_ms": _quantile(turnaround, 0.5) * 1000,
                "turnaround_p99_ms": _quantile(turnaround, 0.99) * 1000,
            }
            if method == "POST":
                self.stats_reset()
            return 200, orjson.dumps(answer)
        return 404, b'{"error":"not_found","message":"no route"}'


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    model = sub.add_parser("model", help="the instant model server")
    model.add_argument("--port", type=int, required=True, help="0: one the system picks (see --port-file)")
    model.add_argument("--port-file", type=Path, help="once listening, write the port here (as the service does)")
    model.add_argument("--completion-tokens", type=int, default=128)
    model.add_argument("--replies", choices=REPLIES, default="as-sampled", help="how the template tokenizes a reply")
    env = sub.add_parser("env", help="the instant env")
    env.add_argument("--port", type=int, required=True, help="0: one the system picks (see --port-file)")
    env.add_argument("--port-file", type=Path, help="once listening, write the port here (as refenv does)")
    env.add_argument("--pool", type=int, default=256)
    env.add_argument("--turns", type=int, default=4, help="completions per episode")
    env.add_argument("--prompt-tokens", type=int, default=2000, help="the first observation's size")
    env.add_argument("--observation-tokens", type=int, default=100, help="what each step adds")
    args = parser.parse_args()
    if args.what == "model":
        _serve(Model(args.completion_tokens, args.replies).handle, args.port, args.port_file)
    else:
        world = Env(args.pool, args.turns, args.prompt_tokens, args.observation_tokens)
        _serve(world.handle, args.port, args.port_file)


if __name__ == "__main__":
    main()
