"""The architecture and the configuration hold their promises: the trainer side imports nothing of
the server, the project's modules import one another without a cycle, the server's and inference's
rooms stay small, and every setting is defined once (flags, variables and the docs' tables come from one
model). What the docs say is checked in tests/test_docs.py, against the code, not against wording."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from refenv import cli as refenv_cli
from refenv.config import Settings, TaskSuite, TeacherSettings
from rollout_service.flags import SettingsError, add_flags, settings_from
from rollout_service.server.config import ENV_PREFIX, ServiceConfig
from rollout_service.tools import cli as service_cli
from rollout_service.tools.measure import wilson_interval


def test_the_trainer_side_imports_nothing_of_the_server():
    code = (
        "import sys, rollout_service.trainer, rollout_service.trainer.export, rollout_service.trainer.trl, "
        "rollout_service.runs; "
        "heavy = [m for m in sys.modules if m.startswith(('rollout_service.server', 'rollout_service.tools', "
        "'rollout_service.cluster', 'fastapi', 'uvicorn', 'starlette', 'vllm', 'torch', 'prometheus_client', 'ray', "
        "'orjson', 'aiohttp', 'httptools', 'trl', 'datasets', 'transformers', 'peft'))]; "
        "print(heavy)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, ServiceConfig, ENV_PREFIX)
    return parser.parse_args(argv)


def test_flags_then_environment_then_defaults():
    environ = {
        "ROLLOUT_ENV": "http://a:1,http://b:2",
        "ROLLOUT_VLLM": "http://v:3",
        "ROLLOUT_MODEL": "m",
        "ROLLOUT_MAX_N": "7",
        "ROLLOUT_MODEL_ENDPOINT": "t=http://x:1,model=big;u=http://y:2",
    }
    config = settings_from(_parse([]), ServiceConfig, ENV_PREFIX, environ)
    assert config.env == ["http://a:1", "http://b:2"] and config.max_n == 7 and config.max_batch == 1024
    assert [(e.name, e.url, e.model) for e in config.model_endpoint] == [
        ("t", "http://x:1", "big"),
        ("u", "http://y:2", None),
    ]
    config = settings_from(_parse(["--max-n", "3", "--env", "http://c:4"]), ServiceConfig, ENV_PREFIX, environ)
    assert config.max_n == 3 and config.env == ["http://c:4"]


def test_an_explicit_falsy_value_is_not_replaced_by_a_default():
    """`--max-n 0` is an error, not silently 64 (the old `args.x or env or default` chains did that)."""
    with pytest.raises(SettingsError) as err:
        settings_from(
            _parse(["--env", "e", "--vllm", "v", "--model", "m", "--max-n", "0"]), ServiceConfig, ENV_PREFIX, {}
        )
    assert "--max-n (ROLLOUT_MAX_N)" in str(err.value)
    with pytest.raises(SettingsError) as err:
        settings_from(_parse([]), ServiceConfig, ENV_PREFIX, {})
    assert "--env (ROLLOUT_ENV): missing" in str(err.value) and "--model (ROLLOUT_MODEL): missing" in str(err.value)


def _settings_read(parser: argparse.ArgumentParser, command: str) -> set[str]:
    """What the command's flags set (`--step` and `--no-step` both set `step`)."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {a.dest for a in sub.choices[command]._actions if a.option_strings and a.dest != "help"}


@pytest.mark.parametrize(
    "parser,command,models",
    [
        (service_cli.build_parser, "serve", [ServiceConfig]),
        (refenv_cli.build_parser, "serve", [Settings]),
        (refenv_cli.build_parser, "teacher", [TeacherSettings, TaskSuite]),
    ],
    ids=["rollout-service serve", "refenv serve", "refenv teacher"],
)
def test_every_flag_of_a_server_is_a_field_of_its_settings_model(parser, command, models):
    """Settings defined once: the servers' flags set exactly their settings models' fields, so none is
    added by hand beside the model (where its default, validation and docs would be a second copy)."""
    assert _settings_read(parser(), command) == {name for model in models for name in model.model_fields}


@pytest.mark.parametrize(
    "passes,trials,lo,hi",
    [
        # Wilson score intervals, 95%, from Newcombe (1998), "Two-sided confidence intervals for the single
        # proportion", Statistics in Medicine 17, table I (method 3).
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
        # At the ends the interval contains the observed rate exactly.
        (10, 10, 0.7225, 1.0),
    ],
)
def test_wilson_interval_matches_published_values(passes, trials, lo, hi):
    got_lo, got_hi = wilson_interval(passes, trials)
    assert got_lo == pytest.approx(lo, abs=1e-4) and got_hi == pytest.approx(hi, abs=1e-4)
    if passes == trials:
        assert got_hi == 1.0
    if passes == 0:
        assert got_lo == 0.0


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout_service", "refenv")


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _run_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node that may run: all but `if TYPE_CHECKING:` blocks, which only the type checker reads."""
    found = []
    pending = [tree]
    while pending:
        node = pending.pop()
        found.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return found


def _module_imports(
    root: Path = ROOT, packages: tuple[str, ...] = PACKAGES, *, inside_functions: bool = False
) -> dict[str, set[str]]:
    """Each module of the packages -> the modules importing it runs at its top level (imports inside
    functions, and `TYPE_CHECKING` ones, are left out: they make no cycle at import). Importing a.b.c
    runs a's and a.b's __init__ first, so those are edges too, but for the importer's own packages,
    which are already being imported when it runs."""
    modules = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _run_nodes(tree) if inside_functions else tree.body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
        own = {name, *_ancestors(name)}
        edges = {m for target in found if target in modules for m in (target, *_ancestors(target))}
        graph[name] = {m for m in edges if m in modules and m not in own}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the modules, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle_among_the_projects_modules():
    assert _cycle(_module_imports()) is None, f"import cycle: {' -> '.join(_cycle(_module_imports()) or [])}"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_cycle_check_sees_a_packages_init_and_not_its_own_packages(tmp_path):
    # A real cycle through a package's __init__ (Python's "partially initialized module"), met only
    # by an edge to the package that `from proj.p.x import X` imports first ...
    cyclic = _tree(
        tmp_path / "a",
        {
            "proj/__init__.py": "",
            "proj/p/__init__.py": "from proj.q import thing\n",
            "proj/p/x.py": "X = 1\n",
            "proj/q.py": "from proj.p.x import X\nthing = X\n",
        },
    )
    assert _cycle(_module_imports(cyclic, ("proj",))) is not None
    # ... and none where a module imports a sibling through its own package, as Python allows.
    fine = _tree(
        tmp_path / "b",
        {"proj/__init__.py": "from proj.a import A\n", "proj/a.py": "from . import b\nA = 1\n", "proj/b.py": ""},
    )
    assert _cycle(_module_imports(fine, ("proj",))) is None


def test_the_cycle_check_finds_a_cycle():
    # The check itself must be able to fail: a two-module cycle, and one through a package's __init__.
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"p": {"p.x"}, "p.x": {"q"}, "q": {"p"}}) == ["p", "p.x", "q", "p"]
    assert _cycle({"p": {"p.x"}, "p.x": set(), "q": {"p", "p.x"}}) is None
    # And the graph must see the project's imports, relative ones included.
    graph = _module_imports()
    assert (
        "rollout_service.backends.transport" in graph["rollout_service.backends.engine"]
        or "rollout_service.backends.transport" in graph["rollout_service.backends.replica_pool"]
    )
    assert "rollout_service.protocol" in graph["rollout_service.server.groups.runner"]


# The server's floors, lowest first, as docs/architecture.md draws them: a module may import its own
# floor and the ones below, never one above. `rollout_service` alone is the shared base (protocol,
# settings, keys); the trainer side imports nothing of the server (test above).
FLOORS: list[tuple[str, ...]] = [
    ("rollout_service",),
    ("rollout_service.trainer",),
    ("rollout_service.backends",),
    ("rollout_service.launch",),
    (
        "rollout_service.server",
        "rollout_service.server.config",
        "rollout_service.server.errors",
        "rollout_service.server.metrics",
        "rollout_service.server.logs",
        "rollout_service.server.task_sets",
        "rollout_service.server.lifecycle",
    ),
    ("rollout_service.server.policy",),
    ("rollout_service.server.membership",),
    ("rollout_service.server.groups",),
    ("rollout_service.server.agents",),  # the agent lane: tries on agent servers, their model endpoint
    ("rollout_service.server.sampler",),
    ("rollout_service.server.service", "rollout_service.server.status"),
    ("rollout_service.server.http", "rollout_service.viewer"),  # the viewer: pages the app serves (/ui)
    ("rollout_service.cluster",),
    ("rollout_service.tools",),
]


def _floor(module: str, floors: list[tuple[str, ...]]) -> int:
    """The floor of the longest prefix that names `module` (a package or one of its modules)."""
    found = [
        (len(prefix), level)
        for level, prefixes in enumerate(floors)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(found)[1]


def _upward(graph: dict[str, set[str]], floors: list[tuple[str, ...]]) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if _floor(target, floors) > _floor(module, floors)
    )


def test_the_servers_arrows_point_one_way():
    """Imports at the top and inside functions alike: a lazy import against the arrows is still an
    arrow against them (the CLI's lazy imports included)."""
    graph = {
        module: targets
        for module, targets in _module_imports(packages=("rollout_service",), inside_functions=True).items()
    }
    assert not _upward(graph, FLOORS), "imports against the floors' order:\n" + "\n".join(_upward(graph, FLOORS))
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_the_arrow_check_sees_an_import_against_the_floors(tmp_path):
    # Break tried: the check must fail on an upward import made inside a function, as the lazy
    # `from ..groups.runner import GroupRunner` in the old start-up module was.
    tree = _tree(
        tmp_path,
        {
            "rollout_service/__init__.py": "",
            "rollout_service/server/__init__.py": "",
            "rollout_service/server/lifecycle.py": "def f():\n    from .groups.runner import GroupRunner\n",
            "rollout_service/server/groups/__init__.py": "",
            "rollout_service/server/groups/runner.py": "from ..lifecycle import f\n",
        },
    )
    graph = _module_imports(tree, ("rollout_service",), inside_functions=True)
    assert "rollout_service.server.lifecycle -> rollout_service.server.groups.runner" in _upward(graph, FLOORS)
    assert _module_imports(tree, ("rollout_service",))["rollout_service.server.lifecycle"] == set()


def test_pydantic_settings_cli_still_lacks_what_flags_gives(monkeypatch):
    """flags.py's reason to exist, asked of the library that could replace it (pydantic-settings' CLI
    source): a list in one variable as `a,b`, and an error that names the flag. If this fails, the
    library now does both: replace flags.py with it."""
    pydantic_settings = pytest.importorskip("pydantic_settings")
    from pydantic import Field

    class Probe(pydantic_settings.BaseSettings):
        model_config = pydantic_settings.SettingsConfigDict(env_prefix="ROLLOUT_PROBE_", cli_kebab_case=True)
        env: list[str] = Field(default_factory=list)
        max_n: int = Field(64, ge=1)

    def read(argv: list[str]) -> object:
        source = pydantic_settings.CliSettingsSource(Probe, root_parser=argparse.ArgumentParser(), cli_kebab_case=True)
        try:
            return Probe(_cli_settings_source=source(args=argv))  # type: ignore[call-arg]
        except Exception as exc:
            return exc

    monkeypatch.setenv("ROLLOUT_PROBE_ENV", "http://a:1,http://b:2")
    assert isinstance(read([]), Exception)  # flags.py: ["http://a:1", "http://b:2"]
    monkeypatch.delenv("ROLLOUT_PROBE_ENV")
    refused = read(["--max-n", "0"])
    assert isinstance(refused, Exception) and "--max-n" not in str(refused)  # flags.py names --max-n and its variable
