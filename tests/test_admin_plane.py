"""Safe by default: two planes with their own keys, closed off loopback; backends are addresses.

A real service, real refenv servers over HTTP and the scripted model (tests/scripted_model.py). What
a real env cannot be made to do (answer an internal page, echo a secret, redirect elsewhere) is a
hostile stand-in in this process, which records every path it was asked: the oracle for "nothing
was fetched".
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import scripted_model
from helpers import cli, wait_until
from starlette.testclient import TestClient

from rollout_service.backends.addresses import system_lookup
from rollout_service.launch.stack import refenv_command
from rollout_service.listening import read_port_file
from rollout_service.trainer.client import RequestRejected, RolloutClient

SAMPLING = {"temperature": 0.8, "max_tokens": 24}
SECRET = "internal-secret-7f3a"  # what a page inside the service's network holds


class _Hostile(BaseHTTPRequestHandler):
    """Every path asked is recorded. /echo/...: 404 with the secret in a JSON message (as an env's
    error would carry it); /text/...: 200 with the secret as plain text (not a model list);
    /redirect/...: 302 to /internal/keys; /internal/keys: the secret itself."""

    asked: list[str]

    def do_GET(self) -> None:
        self.asked.append(self.path)
        if self.path == "/secret-model/v1/models":
            self._answer(200, json.dumps({"object": "list", "data": [{"id": SECRET}]}).encode(), "application/json")
        elif self.path == "/secret-pool/health":
            health = {"status": "ready", "workers": 1, "capabilities": {"pool": SECRET}}
            self._answer(200, json.dumps(health).encode(), "application/json")
        elif self.path in ("/endless/v1/models", "/endless/health"):
            self._endless()
        elif self.path.startswith("/redirect/"):
            self._answer(
                302, b"", "text/plain", {"Location": f"http://127.0.0.1:{self.server.server_port}/internal/keys"}
            )
        elif self.path.startswith("/text/"):
            self._answer(200, f"keys: {SECRET}".encode(), "text/plain")
        elif self.path.startswith("/internal/keys"):
            self._answer(200, json.dumps({"keys": SECRET}).encode(), "application/json")
        else:
            body = json.dumps({"error": "not_found", "message": f"no such page; the keys are {SECRET}"})
            self._answer(404, body.encode(), "application/json")

    do_POST = do_GET

    def _endless(self) -> None:
        """A 200 model list, chunked, that never ends: until the client hangs up."""
        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = b'{"data": [' + b" " * 65536
        try:
            while True:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _answer(self, status: int, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hostile() -> Iterator[tuple[str, list[str]]]:
    """(its URL on 127.0.0.1, the paths it was asked)."""
    asked: list[str] = []
    handler = type("Hostile", (_Hostile,), {"asked": asked})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", asked
    finally:
        server.shutdown()
        server.server_close()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- two planes ----------------------------------------------------------------------------------


def test_the_data_key_runs_groups_and_only_the_admin_key_changes_membership_or_policy(
    start_refenv, start_service, start_scripted_model
):
    """Break tried: `admin_plane()` answering False for every path (one key for all, as before) -> the
    trainer's key adds an env and pauses the policy (fails at the first 401 expected)."""
    model = start_scripted_model("answer")
    env, other = start_refenv("--pool", "2"), start_refenv("--pool", "2")
    keys = {"TEST_DATA_KEY": "trainer-key", "TEST_ADMIN_KEY": "operator-key"}
    service = start_service(
        [env.url],
        "--api-key-env",
        "TEST_DATA_KEY",
        "--admin-key-env",
        "TEST_ADMIN_KEY",
        env=keys,
        vllm=model.url,
        model="scripted",
    )
    data, admin = _bearer("trainer-key"), _bearer("operator-key")
    assert httpx.get(f"{service.url}/health").status_code == 200  # public: a probe needs no key

    # The trainer's key: the data plane, and nothing else.
    assert httpx.get(f"{service.url}/tasks", headers=data).status_code == 200
    assert httpx.get(f"{service.url}/policy", headers=data).status_code == 200
    for method, path, body in [
        ("POST", "/envs", {"url": other.url}),
        ("GET", "/envs", None),
        ("POST", "/envs/drain", {"url": env.url}),
        ("POST", "/replicas", {"url": model.url}),
        ("POST", "/policy", {"version": "v1"}),
        ("POST", "/policy/pause", None),
    ]:
        refused = httpx.request(method, f"{service.url}{path}", json=body, headers=data)
        assert refused.status_code == 401 and "--admin-key-env" in refused.json()["message"], (path, refused.text)
        assert httpx.request(method, f"{service.url}{path}", json=body).status_code == 401, path
    assert other.health()["episodes"]["started"] == 0
    assert httpx.post(f"{service.url}/groups", json={"task_id": "t001"}).status_code == 401
    assert httpx.post(f"{service.url}/groups", json={"task_id": "t001"}, headers=_bearer("wrong")).status_code == 401

    # The client sends each plane's key: groups with the trainer's, membership with the operator's.
    with RolloutClient(service.url, api_key="trainer-key", admin_key="operator-key", timeout_s=60) as client:
        group = client.group(task_id="t001", n=2, sampling=SAMPLING)
        assert group.counts.scored == 2
        assert client.add_env(other.url).pool == 2
        assert sorted(e.url for e in client.envs()) == sorted([env.url, other.url])
    assert env.health()["episodes"]["started"] >= 2
    # An operator's key reads what a trainer reads.
    assert httpx.get(f"{service.url}/tasks", headers=admin).status_code == 200
    # A trainer holding only its key is refused on the admin plane with a clear error.
    with RolloutClient(service.url, api_key="trainer-key") as client, pytest.raises(RequestRejected) as err:
        client.drain_env(other.url)
    assert err.value.status == 401


def _raw(url: str, method: str, target: str, key: str | None, body: bytes = b"") -> tuple[int, str]:
    """One request with `target` sent byte for byte (no client normalizes it): (status, the error code)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Connection: close", f"Content-Length: {len(body)}"]
    if body:
        head.append("Content-Type: application/json")
    if key is not None:
        head.append(f"Authorization: Bearer {key}")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    _, _, payload = answer.partition(b"\r\n\r\n")
    try:
        answer_body = json.loads(payload)
    except ValueError:
        return status, ""
    return status, answer_body.get("error", "") if isinstance(answer_body, dict) else "<not an error body>"


def _path_variants(path: str) -> list[str]:
    """Ways to write a path that a router or a check could read differently from the route's own."""
    first, _, rest = path[1:].partition("/")
    letters = "".join(f"%{ord(c):02X}" if c.isalpha() else c for c in path)
    variants = [path + suffix for suffix in ("%0A", "%0a", "%0D", "%0D%0A", "%09", "%00", "%7F", "%0A%0A")]
    variants += [
        path + "/",  # trailing slash
        "/" + path,  # double slash first
        path.replace("/", "//"),  # every slash doubled
        path + "//",
        "/x/.." + path,  # dot segments
        "/." + path,
        path + "/.",
        path + "/..",
        path.upper(),  # case
        "/" + first.capitalize() + ("/" + rest if rest else ""),
        "/%" + f"{ord(first[0]):02X}" + path[2:],  # one percent-encoded letter
        "/%" + f"{ord(first[0]):02x}" + path[2:],
        letters,  # every letter percent-encoded
        "/" + path[1:].replace("/", "%2F"),  # encoded slashes
        path + "?x=1",  # a query string
        path + "?",
        path + "%0A?x=1",
        path + "%20",
        path + "%3B",
        path + ";x",
    ]
    return variants


def test_the_plane_is_the_matched_routes_under_every_way_of_writing_its_path(
    start_refenv, start_service, start_scripted_model, hostile
):
    """From the app's own route table: every admin route, with the trainers' key, under each variant of
    its path; every data route with no key. None gets the route's answer. The oracle: a hostile env
    and model server, offered as the body of every membership call, are never asked anything.
    Break tried: the exact-string check of the raw path back (`path == "/envs" or ...`) -> `/envs%0A`
    answers 200 with the env list, and `POST /envs%0A` asks the hostile env /health."""
    hostile_url, asked = hostile
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "2")
    keys = {"TEST_DATA_KEY": "trainer-key", "TEST_ADMIN_KEY": "operator-key"}
    service = start_service(
        [env.url], "--api-key-env", "TEST_DATA_KEY", "--admin-key-env", "TEST_ADMIN_KEY",
        env=keys, vllm=model.url, model="scripted",
    )  # fmt: skip
    # The route table as the running app declares it (its OpenAPI schema: every route, with its plane).
    schema = httpx.get(f"{service.url}/openapi.json", headers=_bearer("operator-key")).json()
    routes = [
        (method.upper(), path, operation["x-plane"])
        for path, item in schema["paths"].items()
        for method, operation in item.items()
    ]
    admin = [(m, p) for m, p, plane in routes if plane == "admin"]
    data = [(m, p) for m, p, plane in routes if plane == "data"]
    # Read, not an empty list; and what the operators' plane must hold is on it (this list is the test's own).
    assert {("GET", "/envs"), ("POST", "/envs"), ("POST", "/replicas"), ("POST", "/policy")} <= set(admin), admin
    assert len(admin) >= 9 and len(data) >= 10, routes
    membership = json.dumps({"url": hostile_url, "timeout_s": 2}).encode()  # a valid body: served, it would be asked
    bodies = {"/envs": membership, "/replicas": membership, "/policy": json.dumps({"version": "v9"}).encode()}
    served = []
    for method, path in admin:
        concrete = path.replace("{stream_id}", "s-0")
        body = bodies.get(concrete, b"")
        # The path as declared: refused with the trainers' key, served with the operators' (sanity).
        assert _raw(service.url, method, concrete, "trainer-key", body)[0] == 401, (method, path)
        for target in _path_variants(concrete):
            status, error = _raw(service.url, method, target, "trainer-key", body)
            if status not in (400, 401, 404) or error not in ("invalid_path", "unauthorized", "not_found"):
                served.append((method, target, status, error))
    for method, path in data:
        concrete = path.replace("{stream_id}", "s-0")
        for target in [concrete, *_path_variants(concrete)]:
            status, error = _raw(service.url, method, target, None, b"{}")
            if status not in (400, 401) or error not in ("invalid_path", "unauthorized"):
                served.append((method, target, status, error))
    assert served == [], served
    assert asked == [], "the hostile env or model server was asked something"
    listed = httpx.get(f"{service.url}/envs", headers=_bearer("operator-key")).json()
    assert [e["url"] for e in listed] == [env.url]
    # The public route stays public, and only under its own path.
    assert _raw(service.url, "GET", "/health", None) == (200, "")
    assert _raw(service.url, "GET", "/health%0A", None)[0] == 400
    assert _raw(service.url, "GET", "/health%C2%85", None)[0] == 400  # NEL, a line break to some log readers
    assert _raw(service.url, "GET", "/health%E2%80%A8", None)[0] == 400  # U+2028


def test_the_keys_are_read_from_the_file_compose_and_ray_write(tmp_path, start_refenv, start_service):
    """The key file `rollout-service keys` writes (0600, not overwritten) is what the client reads.
    Break tried: client_keys ignoring key_file -> no key sent (401)."""
    path = tmp_path / "keys" / "rollout.keys"
    made = cli("keys", str(path), env={**os.environ, "ROLLOUT_API_KEY": "", "ROLLOUT_ADMIN_KEY": ""})
    assert made.returncode == 0, made.stderr
    assert (path.stat().st_mode & 0o777) == 0o600
    first = path.read_text()
    assert cli("keys", str(path)).returncode == 0 and path.read_text() == first  # kept, never replaced
    values = dict(line.split("=", 1) for line in first.splitlines() if "=" in line and not line.startswith("#"))
    assert len(values["ROLLOUT_API_KEY"]) >= 32 and values["ROLLOUT_API_KEY"] != values["ROLLOUT_ADMIN_KEY"]

    env = start_refenv("--pool", "2")
    service = start_service(
        [env.url], "--api-key-env", "ROLLOUT_API_KEY", "--admin-key-env", "ROLLOUT_ADMIN_KEY", env=values
    )
    with RolloutClient(service.url, key_file=path) as client:
        assert client.tasks()
        assert [e.url for e in client.envs()] == [env.url]  # the admin key, from the file
    assert httpx.get(f"{service.url}/envs", headers=_bearer(values["ROLLOUT_API_KEY"])).status_code == 401


def _serve(*flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_service.tools.cli", "serve", "--model", "m", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_off_loopback_without_keys_the_service_refuses_to_start_unless_told_insecure(start_refenv, vllm_url, tmp_path):
    """Breaks tried: no check (today's code) -> `--listen 0.0.0.0` starts open; loopback_listen()
    answering True -> the same."""
    env = start_refenv("--pool", "2")
    base = ["--env", env.url, "--vllm", vllm_url, "--listen", "0.0.0.0:0"]
    refused = cli("serve", "--model", "m", *base, timeout=60)
    assert refused.returncode == 2, (refused.returncode, refused.stderr)
    assert "--api-key-env" in refused.stderr and "--admin-key-env" in refused.stderr, refused.stderr
    assert "--insecure-no-auth" in refused.stderr
    # A data key alone guards both planes (one key may serve both): it starts.
    keyed = cli(
        "serve", "--model", "m", *base, "--api-key-env", "K", "--startup-timeout", "0.1", env={**os.environ, "K": "k"}
    )
    assert "not loopback" not in keyed.stderr, keyed.stderr
    # An admin key alone leaves the data plane open: refused too.
    half = cli("serve", "--model", "m", *base, "--admin-key-env", "K", env={**os.environ, "K": "k"}, timeout=60)
    assert half.returncode == 2 and "data plane has no key" in half.stderr, half.stderr

    port_file = tmp_path / "service.port"
    proc = _serve(*base, "--insecure-no-auth", "--model", "smollm2-135m-instruct", "--port-file", str(port_file))
    try:
        assert wait_until(lambda: read_port_file(port_file) is not None, timeout_s=60), proc.poll()
        url = f"http://127.0.0.1:{read_port_file(port_file)}"
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, timeout_s=120)
        warnings = httpx.get(f"{url}/health/detail", timeout=10).json()["warnings"]
        assert any("--insecure-no-auth" in w and "data and admin plane" in w for w in warnings), warnings
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert "--insecure-no-auth" in stderr, stderr


# -- backends are addresses --------------------------------------------------------------------------


def test_a_backend_url_is_an_address_and_a_refusal_never_echoes_what_the_backend_said(
    start_refenv, start_service, start_scripted_model, hostile
):
    """POST /envs and /replicas on a hostile server (allowed: loopback, the default).
    Breaks tried: today's code -> `{url}/internal/keys#` makes the service GET /internal/keys and the
    422 carries the secret; http_url without the query/fragment check -> the hostile server is asked
    /internal/keys; the env's message kept in _ask_env's refusal -> the secret comes back."""
    hostile_url, asked = hostile
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], vllm=model.url, model="scripted")

    for url in (
        f"{hostile_url}/internal/keys#",
        f"{hostile_url}/internal/keys?x=",
        f"{hostile_url}/internal/keys/health",
        f"{hostile_url}/a/../internal/keys",
        f"{hostile_url}/%2e%2e/internal/keys",
        f"http://user:pw@127.0.0.1:{hostile_url.rsplit(':', 1)[1]}/",
    ):
        for path in ("/envs", "/replicas"):
            refused = httpx.post(f"{service.url}{path}", json={"url": url, "timeout_s": 5}, timeout=30)
            assert refused.status_code == 422 and refused.json()["error"] == "invalid_request", (url, refused.text)
    assert asked == [], "nothing was asked of a URL that is not an address"

    # An address: asked, refused by status and kind, and what it said is not repeated.
    refused = httpx.post(f"{service.url}/envs", json={"url": f"{hostile_url}/echo", "timeout_s": 10}, timeout=30)
    assert refused.status_code == 422 and refused.json()["error"] == "env_refused", refused.text
    assert "404" in refused.json()["message"] and "env_rejected" in refused.json()["message"], refused.text
    assert SECRET not in refused.text
    assert asked == ["/echo/health"]
    refused = httpx.post(f"{service.url}/replicas", json={"url": f"{hostile_url}/text", "timeout_s": 10}, timeout=30)
    assert refused.status_code == 422 and refused.json()["error"] == "replica_refused", refused.text
    assert SECRET not in refused.text and "not an OpenAI model list" in refused.json()["message"]
    # A redirect is an answer, not followed.
    refused = httpx.post(f"{service.url}/envs", json={"url": f"{hostile_url}/redirect", "timeout_s": 10}, timeout=30)
    assert refused.status_code == 422 and SECRET not in refused.text, refused.text
    assert not [p for p in asked if p.startswith("/internal")], asked
    detail = httpx.get(f"{service.url}/health/detail", timeout=10).json()
    assert SECRET not in json.dumps(detail)

    # A configured backend is checked at start the same way.
    bad = cli("serve", "--model", "m", "--env", f"{env.url}/?x=1", "--vllm", model.url, timeout=60)
    assert bad.returncode == 2 and "--env" in bad.stderr and "query or fragment" in bad.stderr, bad.stderr


def test_a_backends_refusal_names_no_value_it_sent_and_an_endless_model_list_is_refused_at_once(
    start_refenv, start_service, start_scripted_model, hostile
):
    """Stand-ins a real backend cannot be made into: a model server listing only a secret model id, an
    env whose /health carries a secret as its pool size, a model server whose model list never ends.
    Breaks tried: the listed names in ask_model's refusal (`serves [...]`) -> the secret is in the 422;
    `pool!r` in EnvHealth's check -> the secret is in the 422; the cap error read as unreachable (the
    old models() mapping) -> the endless list is asked again and again and POST /replicas answers 504
    at timeout_s, not 422 at once; the env's refusal worded as before -> "it answered None"."""
    hostile_url, asked = hostile
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], "--max-answer-bytes", str(1 << 20), vllm=model.url, model="scripted")

    refused = httpx.post(
        f"{service.url}/replicas", json={"url": f"{hostile_url}/secret-model", "timeout_s": 10}, timeout=30
    )
    assert refused.status_code == 422 and refused.json()["error"] == "replica_refused", refused.text
    assert SECRET not in refused.text and "'scripted'" in refused.json()["message"], refused.text
    assert "1 other model" in refused.json()["message"], refused.text

    refused = httpx.post(f"{service.url}/envs", json={"url": f"{hostile_url}/secret-pool", "timeout_s": 10}, timeout=30)
    assert refused.status_code == 422 and refused.json()["error"] == "env_refused", refused.text
    assert SECRET not in refused.text and "capabilities.pool" in refused.json()["message"], refused.text
    assert "not a str" in refused.json()["message"] and "None" not in refused.json()["message"], refused.text

    refused = httpx.post(
        f"{service.url}/replicas", json={"url": f"{hostile_url}/endless", "timeout_s": 120}, timeout=150
    )
    assert refused.status_code == 422 and refused.json()["error"] == "replica_refused", refused.text
    assert "--max-answer-bytes" in refused.json()["message"], refused.text
    assert asked.count("/endless/v1/models") == 1, asked  # refused on the first answer, never asked again
    refused = httpx.post(f"{service.url}/envs", json={"url": f"{hostile_url}/endless", "timeout_s": 120}, timeout=150)
    assert refused.status_code == 422 and refused.json()["error"] == "env_refused", refused.text
    message = refused.json()["message"]
    assert "env_answer_too_large" in message and "answered None" not in message, message
    assert asked.count("/endless/health") == 1, asked
    assert SECRET not in json.dumps(httpx.get(f"{service.url}/health/detail", timeout=10).json())


def _refenv_at(launch, host: str):
    cmd = [*refenv_command(0, "--pool", "2"), "--listen", f"{host}:0"]  # the last --listen counts
    running = launch("refenv", None, cmd, wait=False)
    running.url = running.url.replace("127.0.0.1", host)
    assert wait_until(lambda: httpx.get(f"{running.url}/health", timeout=5).status_code == 200, timeout_s=60)
    return running


def test_allow_backends_bounds_what_membership_may_reach_by_resolved_address(launch, start_service, hostile):
    """Everything real on 127.0.0.2, allowed; the hostile server on 127.0.0.1, not (the list replaces
    the loopback default). No spelling reaches it: the issue's decimal IP, a DNS name, IPv6, hex.
    Breaks tried: no check (today's code) -> POST /envs asks the hostile server; AllowedBackends.check
    matching the URL's host text against the list instead of the resolved address -> the decimal
    2130706433 and `localhost` get through."""
    hostile_url, asked = hostile
    port = hostile_url.rsplit(":", 1)[1]
    env = _refenv_at(launch, "127.0.0.2")
    second = _refenv_at(launch, "127.0.0.2")
    model = launch("model", None, scripted_model.command(0, "answer", "--host", "127.0.0.2"), wait=False)
    model_url = model.url.replace("127.0.0.1", "127.0.0.2")
    assert wait_until(lambda: httpx.get(f"{model_url}/v1/models", timeout=5).status_code == 200, timeout_s=60)
    service = start_service([env.url], "--allow-backends", "127.0.0.2", vllm=model_url, model="scripted")

    for spelling in ("127.0.0.1", "2130706433", "localhost", "0x7f.0.0.1", "127.1", "[::ffff:127.0.0.1]"):
        for path in ("/envs", "/replicas"):
            url = f"http://{spelling}:{port}"
            refused = httpx.post(f"{service.url}{path}", json={"url": url, "timeout_s": 5}, timeout=30)
            assert refused.status_code == 422, (url, refused.text)
            assert refused.json()["error"] in ("backend_not_allowed", "invalid_request"), refused.text
            if refused.json()["error"] == "backend_not_allowed":
                assert "--allow-backends" in refused.json()["message"]
    assert asked == [], asked
    # What is allowed joins.
    added = httpx.post(f"{service.url}/envs", json={"url": second.url}, timeout=60)
    assert added.status_code == 201, added.text
    with RolloutClient(service.url, timeout_s=60) as client:
        assert client.group(task_id="t001", n=2, sampling=SAMPLING).counts.scored == 2


def test_by_default_only_loopback_and_the_backends_given_at_start_may_be_added(start_refenv, start_service):
    """Break tried: AllowedBackends with no default entry -> a non-loopback address is asked (and the
    request waits for it until timeout_s: 504, not 422)."""
    env = start_refenv("--pool", "2")
    service = start_service([env.url])
    for url in ("http://10.255.255.1:8090", "http://169.254.169.254", "http://0.0.0.0:1"):
        refused = httpx.post(f"{service.url}/envs", json={"url": url, "timeout_s": 30}, timeout=30)
        assert refused.status_code == 422 and refused.json()["error"] == "backend_not_allowed", (url, refused.text)


class _Recorder(BaseHTTPRequestHandler):
    """Stands for what sits inside the network on a forbidden address: records every path asked."""

    asked: list[str]

    def do_GET(self) -> None:
        self.asked.append(self.path)
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    do_POST = do_DELETE = do_GET

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _recording(host: str, port: int) -> Iterator[list[str]]:
    asked: list[str] = []
    server = ThreadingHTTPServer((host, port), type("Recorder", (_Recorder,), {"asked": asked}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield asked
    finally:
        server.shutdown()
        server.server_close()


class _RebindingNames:
    """A resolver stand-in (DNS answers cannot be made to change on purpose here): each name listed
    answers its addresses in turn, the last one from then on; any other name, the system's answer."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str]] = {}

    async def __call__(self, host: str, port: int, family: int) -> list:
        queue = self.answers.get(host)
        if queue is None:
            return await system_lookup(host, port, family)
        address = queue.pop(0) if len(queue) > 1 else queue[0]
        flags = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV
        return [{"hostname": host, "host": address, "port": port, "family": socket.AF_INET, "proto": 0, "flags": flags}]


def test_a_name_that_resolves_elsewhere_later_is_not_connected_to(start_refenv, start_scripted_model):
    """DNS rebinding: a name that resolved to an allowed address when its env or replica was added
    and resolves later to a forbidden one. The policy holds at each connection: the name is resolved,
    its address checked, and the checked address is the one connected to. Real refenvs and scripted
    model servers on 127.0.0.1 (allowed); on 127.0.0.2, the same ports, a recorder (forbidden: the
    list is 127.0.0.1 alone). The recorder's log is the oracle for "nothing was sent there".
    Break tried: the old transport (no resolver of its own; the check at POST only) -> the probes of
    POST /envs and /replicas went to the recorder, fails."""
    from rollout_service.server.config import ServiceConfig
    from rollout_service.server.http.app import create_app
    from rollout_service.server.service import RolloutService

    first, second = start_refenv("--pool", "2"), start_refenv("--pool", "2")
    model, other_model = start_scripted_model("answer"), start_scripted_model("answer")
    env_port, model_port = int(second.url.rsplit(":", 1)[1]), int(other_model.url.rsplit(":", 1)[1])
    config = ServiceConfig(env=[first.url], vllm=[model.url], model="scripted", allow_backends=["127.0.0.1"])
    service = RolloutService(config)
    names = _RebindingNames()
    service.allowed.lookup = names
    with (
        _recording("127.0.0.2", env_port) as env_side,
        _recording("127.0.0.2", model_port) as model_side,
        TestClient(create_app(config, service), base_url="http://127.0.0.1") as client,
    ):
        assert wait_until(lambda: client.get("/health").json()["status"] == "ok", timeout_s=60)
        # Allowed when checked, elsewhere when connected to: refused at once, with the reason.
        names.answers["early-env.test"] = ["127.0.0.1", "127.0.0.2"]
        refused = client.post("/envs", json={"url": f"http://early-env.test:{env_port}", "timeout_s": 30})
        assert refused.status_code == 422 and refused.json()["error"] == "env_refused", refused.text
        assert "127.0.0.2" in refused.json()["message"] and "--allow-backends" in refused.json()["message"]
        names.answers["early-model.test"] = ["127.0.0.1", "127.0.0.2"]
        body = {"url": f"http://early-model.test:{model_port}", "timeout_s": 30}
        refused = client.post("/replicas", json=body)
        assert refused.status_code == 422 and refused.json()["error"] == "replica_refused", refused.text
        assert "127.0.0.2" in refused.json()["message"], refused.text
        # Allowed while it is added and runs episodes; elsewhere later.
        names.answers["late-env.test"] = ["127.0.0.1"]
        added = client.post("/envs", json={"url": f"http://late-env.test:{env_port}", "timeout_s": 60})
        assert added.status_code == 201, added.text
        assert client.post("/envs/drain", json={"url": first.url}).status_code == 200
        group = client.post("/groups", json={"task_id": "t001", "n": 2, "sampling": SAMPLING, "timeout_s": 120})
        assert group.status_code == 200 and group.json()["counts"]["scored"] == 2, group.text
        assert second.health()["episodes"]["finished"] == 2  # the env's own count: they ran behind the name
        names.answers["late-env.test"] = ["127.0.0.2"]
        # The monitor asks its /health every few seconds, on a new connection once the last one idled
        # out: it is refused there, and says why.
        assert wait_until(lambda: "127.0.0.2" in json.dumps(client.get("/health/detail").json()), timeout_s=60)
        assert second.health()["live_episodes"] == 0
    assert env_side == [] and model_side == [], (env_side, model_side)
