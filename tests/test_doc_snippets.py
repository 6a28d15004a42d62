"""Every code snippet of README.md and docs/*.md runs as written, against a real stack.

A fenced block's info string says what it is, and that decides what is done with it:

- `python`: run, in a fresh interpreter of this environment, against a real refenv, the service and
  the session's CPU vLLM (tests/conftest.py). A page's blocks run in page order, in one working
  folder of the page's own, so a block may use a file an earlier block of that page wrote.
- `sh` / `bash`: run by bash (`set -e`, `pipefail`), with this environment's `bin/` first on PATH,
  in the same folder. A command fails the block if it exits non-zero or prints an error body of
  the service (`"error":`), since curl exits 0 on a 4xx.
- `yaml`: a Ray deployment file (the only YAML the docs show): validated by `ClusterConfig`.
- `json`: parsed (a leading `METHOD /path` is an HTTP sketch: the JSON is what follows it); a
  request is validated by its model (`GroupRequest`, or `SampleRequest` for a sample); a returned
  group (abridged, with `…`) has its keys checked against `GroupResult`, nested models included.
- `text`: a diagram, a tree or an HTTP sketch: not code, listed.
A block without an info string fails the test: its author decides which of these it is.

`<!-- snippet: skip, REASON -->` on the line before a fence keeps it from running (a GPU, Docker,
Ray, GraphJin, a foreground server, a run of minutes). The reason is required, and the skipped
blocks are listed in the summary. A skipped block is still checked for what can be checked
without running it: Python is compiled and every keyword a call passes to a callable imported by
name is checked against its signature; every `rollout-service` and `refenv` command line, and every
`python bench/*.py` or `python examples/*.py` one, is parsed by the program's own parser (`[...]`
optional parts and `...` placeholders left out), so a renamed parameter or flag fails here too.
So is a command named in the prose (`rollout-service ray up` in backticks): its subcommands and
flags must exist. Each skipped block is a skipped test with its reason, so `pytest -ra` lists them.

The URL rule: snippets are written for the service at `http://127.0.0.1:8080`, as a reader runs it;
the runner replaces `127.0.0.1:8080` and `localhost:8080` with the test's service before it runs a
block, and sets `ROLLOUT_URL` to that service's URL. Nothing else in a block is changed.

Keep runnable snippets small (n, max_tokens, max_turns, steps) so this file stays within minutes.

Breaks tried: `RolloutClient(key_file=)` renamed (the security page's block fails to run, and the
call check names it); `token_batch`'s `old_logprobs` key renamed (the trainer page's block fails);
the sampler example's families named after refenv's categories again (404 `unknown_family`);
`rollout-service stack` in the prose, `serve --envs` in a block (refused by the parser).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from refenv import cli as refenv_cli
from rollout_service.cluster.config import ClusterConfig
from rollout_service.protocol import GroupRequest, GroupResult
from rollout_service.sampler_protocol import SampleRequest
from rollout_service.tools import cli as service_cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "sh", "bash"}
KINDS = RUN | {"yaml", "json", "text"}
SKIP = re.compile(r"<!--\s*snippet:\s*skip,\s*(?P<reason>\S.*?)\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>[^\s`]*)")
SERVICE_ADDRESS = re.compile(r"\b(?:127\.0\.0\.1|localhost):8080\b")
PROGRAMS = {"rollout-service": service_cli.build_parser, "refenv": refenv_cli.build_parser}
# The README's loop trains a 135M model on the CPU: minutes on a machine that runs the rest of the suite beside it.
BLOCK_TIMEOUT_S = 600


@dataclass
class Snippet:
    page: Path
    line: int  # the fence's line, 1-based
    kind: str
    code: str
    skip: str | None  # the reason it is not run

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marked = SKIP.fullmatch(before)
        found.append(Snippet(page, i + 1, m["info"], body, marked["reason"] if marked else None))
        i = end + 1
    return found


ALL = [s for page in PAGES for s in snippets(page)]


def test_every_block_says_what_it_is_and_why_it_is_skipped():
    untyped = [s.where for s in ALL if s.kind not in KINDS]
    assert not untyped, f"give these fences an info string ({', '.join(sorted(KINDS))}): {untyped}"
    stray = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in PAGES
        for m in re.finditer(r"<!--\s*snippet:.*?-->", p.read_text())
        if not SKIP.fullmatch(m.group(0))
    ]
    assert not stray, f"a snippet marker that is not `<!-- snippet: skip, REASON -->`: {stray}"
    marked_not_code = [s.where for s in ALL if s.skip and s.kind not in RUN]
    assert not marked_not_code, f"only python and sh blocks are run, so only they can be skipped: {marked_not_code}"
    ran = [s for s in ALL if s.kind in RUN and not s.skip]
    skipped = [s for s in ALL if s.skip]
    assert len(ran) >= 8, "the docs' trainer code runs: a rule that skipped everything would pass otherwise"
    print(f"\n{len(ran)} blocks run, {len(skipped)} skipped:")
    for s in skipped:
        print(f"  {s.where} ({s.kind}): {s.skip}")


# ---- what is checked without running ------------------------------------------------------------


def _command_lines(code: str) -> list[list[str]]:
    """Each command of a shell block as words: continuations joined, comments and `[...]` optional
    parts dropped, `VAR=value` prefixes and `$(...)` assignments left to the shell."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        line = re.sub(r"\[[^\]]*\]", "", line)  # optional parts, as a synopsis writes them
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            words.pop(0)
        if words:
            commands.append([w for w in words if w != "..."])
    return commands


# Runs a script of this repository only as far as its argument parser: parse_args returns, then the
# process exits 0, before the script does anything with what it parsed.
PARSE_ONLY = """
import argparse, os, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parse_and_stop(self, *args, **kwargs):
    parse(self, *args, **kwargs)
    sys.exit(0)
argparse.ArgumentParser.parse_args = parse_and_stop
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python SCRIPT` puts it
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def check_commands(snippet: Snippet) -> list[str]:
    """Every `rollout-service` and `refenv` command, and every `python bench/*.py` or `examples/*.py`
    one, is accepted by its program's own parser."""
    problems = []
    for words in _command_lines(snippet.code):
        program = words[0].rsplit("/", 1)[-1]
        if program in PROGRAMS:
            refused = io.StringIO()
            try:
                with contextlib.redirect_stderr(refused):
                    PROGRAMS[program]().parse_args(words[1:])
            except SystemExit as exc:
                if exc.code:
                    problems.append(f"{snippet.where}: `{' '.join(words)}`: {refused.getvalue().strip()}")
        elif program.startswith("python") and len(words) > 1 and re.fullmatch(r"(bench|examples)/[\w/]+\.py", words[1]):
            done = subprocess.run(
                [sys.executable, "-c", PARSE_ONLY, *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120
            )
            if done.returncode:
                problems.append(f"{snippet.where}: `{' '.join(words)}`: {done.stderr.strip()[-1000:]}")
    return problems


def _imported_callables(tree: ast.Module) -> dict[str, object]:
    found: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module = importlib.import_module(node.module)
            for alias in node.names:
                target = getattr(module, alias.name, None)
                assert target is not None, f"{node.module} has no {alias.name}"
                found[alias.asname or alias.name] = target
    return found


def check_python(snippet: Snippet) -> list[str]:
    """Compiles, imports what it imports, and passes only keywords its imported callables take."""
    tree = ast.parse(snippet.code, filename=snippet.where)
    try:
        callables = _imported_callables(tree)
    except (AssertionError, ImportError) as exc:
        return [f"{snippet.where}: {exc}"]
    problems = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in callables):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue
        try:
            signature = inspect.signature(callables[node.func.id])  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        try:
            signature.bind_partial(*node.args, **{k.arg: None for k in node.keywords if k.arg})
        except TypeError as exc:
            problems.append(f"{snippet.where}, line {node.lineno}: {node.func.id}(...): {exc}")
    return problems


INLINE_COMMAND = re.compile(r"`(?:\.venv/bin/)?(rollout-service|refenv)((?: [^`]*)?)`")


def check_inline_commands(page: Path) -> list[str]:
    """A command named in the prose (`rollout-service ray up`, `refenv serve --pool 8`) names
    subcommands and flags its program has; a mention need not be complete, so nothing is required."""
    problems = []
    for m in INLINE_COMMAND.finditer(page.read_text()):
        parser = PROGRAMS[m[1]]()
        words = [w for w in re.sub(r"\[[^\]]*\]", "", m[2]).split() if w != "..."]
        for word in words:
            if word.startswith("-"):
                if word.split("=")[0] not in parser._option_string_actions:
                    problems.append(f"{page.relative_to(ROOT)}: {m[0]}: no flag {word} in `{parser.prog}`")
                continue
            commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if not commands:
                continue  # a positional argument (FILE, RUN)
            if word not in commands[0].choices:
                problems.append(f"{page.relative_to(ROOT)}: {m[0]}: `{parser.prog}` has no command {word}")
                break
            parser = commands[0].choices[word]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_named_in_the_prose_exist(page):
    problems = check_inline_commands(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("snippet", [s for s in ALL if s.kind in RUN], ids=lambda s: s.where)
def test_every_command_and_call_is_accepted(snippet):
    """Run or not, a snippet's commands parse and its calls name parameters that exist."""
    problems = check_python(snippet) if snippet.kind == "python" else check_commands(snippet)
    assert not problems, "\n".join(problems)
    if snippet.skip:  # listed with its reason in pytest's summary (`-ra`, as `make test` runs it)
        pytest.skip(f"{snippet.where} checked, not run: {snippet.skip}")


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _unknown_keys(value: object, model: type[BaseModel], path: str) -> list[str]:
    if isinstance(value, list):
        return [k for item in value for k in _unknown_keys(item, model, f"{path}[]")]
    if not isinstance(value, dict):
        return []
    fields = {info.alias or name: info for name, info in model.model_fields.items()}
    unknown = []
    for key, item in value.items():
        if key == "…":
            continue
        if key not in fields:
            unknown.append(f"{path}.{key}")
        elif nested := _models_in(fields[key].annotation):
            unknown += _unknown_keys(item, nested[0], f"{path}.{key}")
    return unknown


def _json_body(code: str) -> object:
    sketch = re.match(r"\s*[A-Z]+ /\S*\s", code)
    return json.loads(code[sketch.end() :] if sketch else code)


@pytest.mark.parametrize("snippet", [s for s in ALL if s.kind == "json"], ids=lambda s: s.where)
def test_json_blocks_parse_and_group_requests_are_valid(snippet):
    try:
        body = _json_body(snippet.code)
    except json.JSONDecodeError:
        pytest.fail(f"{snippet.where}: not JSON (an abridged answer is `text`)")
    if not isinstance(body, dict):
        return
    if "attempts" in body:  # a returned group, abridged (`…`): its values are not checked, its keys are
        unknown = _unknown_keys(body, GroupResult, "group")
        assert not unknown, f"{snippet.where}: no such field: {unknown}"
        return
    if re.match(r"\s*POST /groups/sample\s", snippet.code) or "count" in body:
        SampleRequest.model_validate(body)
    elif re.match(r"\s*POST /groups\s", snippet.code) or "task_id" in body or "slug" in body:
        GroupRequest.model_validate(body)


@pytest.mark.parametrize("snippet", [s for s in ALL if s.kind == "yaml"], ids=lambda s: s.where)
def test_yaml_blocks_are_valid_ray_deployment_files(snippet):
    ClusterConfig.model_validate(yaml.safe_load(snippet.code))


# ---- what runs ---------------------------------------------------------------------------------


def _run_block(snippet: Snippet, url: str, cwd: Path) -> subprocess.CompletedProcess:
    code = SERVICE_ADDRESS.sub(url.removeprefix("http://"), snippet.code)
    env = {
        **os.environ,
        "ROLLOUT_URL": url,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
    }
    if snippet.kind == "python":
        script = cwd / f"snippet_{snippet.line}.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-c", "set -eo pipefail\n" + code]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)


RUN_PAGES = sorted({s.page for s in ALL if s.kind in RUN and not s.skip})


@pytest.mark.early  # minutes of CPU training and generation: started late, the other workers would wait for it
@pytest.mark.timeout(2 * BLOCK_TIMEOUT_S)
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_pages_snippets_run_against_the_service(page, start_refenv, start_service, tmp_path):
    env = start_refenv("--pool", "8")
    service = start_service([env.url], "--runs-dir", str(tmp_path / "runs"))
    for snippet in snippets(page):
        if snippet.kind not in RUN or snippet.skip:
            continue
        try:
            done = _run_block(snippet, service.url, tmp_path)
        except subprocess.TimeoutExpired as exc:
            said = b"".join(x if isinstance(x, bytes) else (x or "").encode() for x in (exc.stdout, exc.stderr))
            pytest.fail(f"{snippet.where} ran past {BLOCK_TIMEOUT_S} s:\n{said.decode(errors='replace')[-4000:]}")
        output = (done.stdout + done.stderr)[-4000:]
        assert done.returncode == 0, f"{snippet.where} exited {done.returncode}:\n{output}"
        assert '"error":' not in done.stdout, f"{snippet.where} printed an error of the service:\n{output}"
