"""A stand-in env whose every word is hostile markup, for tests/test_viewer.py.

A stand-in because no real part can be made to say it: refenv's prompts and answers come from its own
task suite, and the real model will not write `<script>` on demand. It speaks the step contract
(/health, /tasks, /step/reset, /step, DELETE /step/{id}) with one task whose prompt, answer, score and
error messages carry HOSTILE. Episodes in the order reset: the 1st and every 3rd after it is scored 1,
the 2nd (and every 3rd after) fails at reset with a 500 whose message is hostile, the 3rd is scored 0:
a group of 3 has signal and one failed attempt.

    python tests/hostile_env.py --port 0 --port-file PATH
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rollout_service.listening import write_port_file

# What the viewer must show as text: a script and an image whose error handler would each set a global.
HOSTILE = '<script>window.__pwned = "script"</script><img src=x onerror="window.__pwned = \'img\'"> end'
TASK = {"task_id": "hostile", "slug": "hostile-text", "prompt": HOSTILE, "family": "hostile", "category": "markup"}
POOL = 4

_lock = threading.Lock()
_episodes: dict[str, int] = {}
_numbers = itertools.count()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet: the test's log holds the service's lines
        pass

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        length = int(self.headers.get("content-length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(
                200,
                {
                    "status": "ready",
                    "workers": POOL,
                    "tasks": 1,
                    "dataset": {"catalog_hash": "hostile-1"},
                    "reward_version": "hostile-1",
                    "reward_profile": "rl",
                    "capabilities": {"drive_modes": ["step"], "pool": POOL},
                },
            )
        elif self.path == "/tasks":
            self._answer(200, {"tasks": [TASK], "count": 1})
        else:
            self._answer(404, {"error": "not_found", "message": self.path})

    def do_POST(self) -> None:
        body = self._body()
        if self.path == "/step/reset":
            with _lock:
                number = next(_numbers)
                episode = f"h-{number}"
                if number % 3 != 1:
                    _episodes[episode] = number
            if number % 3 == 1:
                self._answer(500, {"error": "episode_failed", "message": f"preparation failed: {HOSTILE}"})
                return
            messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": HOSTILE}]
            self._answer(
                200,
                {
                    "episode_id": episode,
                    "task_id": TASK["task_id"],
                    "slug": TASK["slug"],
                    "done": False,
                    "observation": {"stage": "executor", "messages": messages},
                },
            )
        elif self.path == "/step":
            with _lock:
                number = _episodes.pop(body.get("episode_id", ""), None)
            if number is None:
                self._answer(410, {"error": "episode_gone", "message": "unknown episode"})
                return
            reward = 1.0 if number % 3 == 0 else 0.0
            self._answer(
                200,
                {
                    "episode_id": body["episode_id"],
                    "task_id": TASK["task_id"],
                    "slug": TASK["slug"],
                    "done": True,
                    "status": "finished",
                    "answer": HOSTILE,
                    "pass": reward == 1.0,
                    "reward": reward,
                    "score": {"vector": {"reward": reward}, "pass": reward == 1.0, "note": HOSTILE},
                },
            )
        else:
            self._answer(404, {"error": "not_found", "message": self.path})

    def do_DELETE(self) -> None:
        with _lock:
            _episodes.pop(self.path.removeprefix("/step/"), None)
        self._answer(200, {"episode_id": self.path.removeprefix("/step/"), "done": True, "status": "abandoned"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--port-file", type=Path)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    if args.port_file:
        write_port_file(args.port_file, server.server_address[1])
    server.serve_forever()


if __name__ == "__main__":
    main()
