"""Each Docker image holds what the commands it runs import, with no Docker engine.

For each Dockerfile: its `pip install` steps are read, and the distributions those steps would put in
the image are found from the packages' own metadata (each requirement with its dependencies,
`--no-deps` ones alone, requirement files and the project's extras from pyproject.toml), using the
versions this checkout's .venv holds. A fresh virtual environment (no system site packages) is given
exactly those distributions (linked from .venv: nothing is downloaded), and in it each command the
image runs is started with `--help`, then every module that command loads is imported: the modules
its handler imports, and, from there, every module our packages import, at the top or inside a
function (the imports a command makes only when it gets there). What would fail in the image with
"No module named ..." fails here.

What it does not reproduce: the image's own base (Debian's python3.11 here, the same as .venv's) and
anything apt installs; the versions pip would resolve at build time (those of .venv stand in).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import venv
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
PROJECT = "rollout-service"
OUR_PACKAGES = ("rollout_service", "inference", "refenv")


# -- what a Dockerfile installs ---------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        pending += line
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def pip_installs(path: Path) -> list[tuple[list[str], bool]]:
    """Each `pip install` a Dockerfile's RUN steps make: (requirements, no_deps), a requirement file given
    as `-r` read from where its COPY took it, the project (a local path, with its extras) as `PROJECT[...]`."""
    copied: dict[str, str] = {}  # a path in the image -> the repo path it came from
    installs: list[tuple[list[str], bool]] = []
    for word, rest in dockerfile_instructions(path):
        if word == "COPY":
            sources, dest = rest.split()[:-1], rest.split()[-1]
            for source in sources:
                target = dest.rstrip("/") + "/" + Path(source).name if dest.endswith("/") else dest
                copied[target] = source
        if word != "RUN":
            continue
        for command in re.split(r"&&|;", rest):
            words = shlex.split(command)
            if "pip" not in " ".join(words[:4]) or "install" not in words:
                continue
            args = words[words.index("install") + 1 :]
            no_deps, reqs, i = False, [], 0
            while i < len(args):
                arg = args[i]
                if arg == "--no-deps":
                    no_deps = True
                elif arg in ("-r", "--requirement"):
                    i += 1
                    reqs += requirement_file(ROOT / copied[args[i]])
                elif arg in ("--find-links", "-f", "--index-url", "-i", "--extra-index-url", "-c"):
                    i += 1
                elif arg.startswith("-"):
                    pass
                elif arg.startswith(("/", ".")):  # the project, from where COPY put it
                    extras = re.search(r"\[(.*)\]$", arg)
                    reqs.append(f"{PROJECT}[{extras.group(1)}]" if extras else PROJECT)
                else:
                    reqs.append(arg)
                i += 1
            installs.append((reqs, no_deps))
    return installs


def requirement_file(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


# -- the distributions those installs bring ---------------------------------------------------------


def _project_requires(extras: set[str]) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return reqs


def closure(installs: list[tuple[list[str], bool]]) -> set[str]:
    """The canonical names of every distribution the installs put in the image (the project included)."""
    found: set[str] = set()
    todo: list[tuple[str, bool, set[str]]] = []
    for reqs, no_deps in installs:
        for text in reqs:
            req = Requirement(text)
            todo.append((req.name, no_deps, set(req.extras)))
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, no_deps, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, frozenset(extras)) in seen:
            continue
        seen.add((key, frozenset(extras)))
        found.add(key)
        if no_deps:
            continue
        if key == PROJECT:
            requires = _project_requires(extras)
        else:
            try:
                requires = metadata.requires(name) or []
            except metadata.PackageNotFoundError:
                pytest.fail(f"{name} (needed by an image) is not installed in .venv: run make setup")
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""}) | {""}):
                continue
            todo.append((req.name, False, set(req.extras)))
    return found


def _site_packages() -> Path:
    return Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()))


def _installed() -> dict[str, tuple[Path, list[str]]]:
    """.venv's distributions: canonical name -> (its dist-info folder, the paths its RECORD lists). Read
    as text: importlib.metadata's file objects take most of a minute over torch and vLLM."""
    found: dict[str, tuple[Path, list[str]]] = {}
    for info in _site_packages().glob("*.dist-info"):
        record = info / "RECORD"
        if not record.is_file():
            continue
        name = info.name.removesuffix(".dist-info").rsplit("-", 1)[0]
        paths = [line.split(",", 1)[0] for line in record.read_text(errors="replace").splitlines() if line]
        found[canonicalize_name(name)] = (info, paths)
    return found


def make_venv(where: Path, dists: set[str]) -> Path:
    """A virtual environment without system site packages holding exactly `dists` (linked from .venv), the
    project as its packages; its python."""
    venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True).create(where)
    python = where / "bin" / "python"
    site = where / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    source_site = _site_packages()
    installed = _installed()
    owners: dict[str, set[str]] = {}  # a name directly in site-packages -> the distributions with files under it
    for name, (_, paths) in installed.items():
        for path in paths:
            owners.setdefault(path.split("/", 1)[0], set()).add(name)
    for name in sorted(dists - {PROJECT}):
        if name not in installed:
            pytest.fail(f"{name} (an image installs it) is not installed in .venv: run make setup")
        for path in installed[name][1]:
            top = path.split("/", 1)[0]
            if top in ("..", "") or path.endswith(".pth"):
                continue
            # Its own folder is linked whole (its compiled files with it); one shared with another
            # distribution (a namespace package) file by file.
            relative = top if owners[top] == {name} else path
            source, target = source_site / relative, site / relative
            if target.exists() or target.is_symlink() or not source.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(source)
    for package in OUR_PACKAGES:
        (site / package).symlink_to(ROOT / package)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = site / f"rollout_service-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PROJECT}\nVersion: {project['version']}\n")
    return python


# -- what each image runs ---------------------------------------------------------------------------


def entrypoint(path: Path) -> list[str]:
    """The image's ENTRYPOINT, else its CMD (exec form)."""
    found: dict[str, list[str]] = {}
    for word, rest in dockerfile_instructions(path):
        if word in ("ENTRYPOINT", "CMD"):
            found[word] = json.loads(rest)
    return found.get("ENTRYPOINT") or found["CMD"]


def compose_commands() -> dict[str, set[tuple[str, str]]]:
    """The (program, command) pairs each image runs in the compose files: image name -> pairs."""
    runs: dict[str, set[tuple[str, str]]] = {}
    for file in ("compose.yaml", "compose.cpu.yaml"):
        services = yaml.safe_load((DOCKER / file).read_text())["services"]
        for service in services.values():
            image = service["image"].replace("${ENV_IMAGE:-", "").rstrip("}")
            command = service.get("command") or []
            text = command if isinstance(command, str) else " ".join(command)
            text = re.sub(r"\$\{ENV_COMMAND:-(.*)\}", r"\1", text)
            for program, sub in re.findall(r"\b(rollout-service|refenv) ([a-z][a-z-]*)", text):
                runs.setdefault(image, set()).add((program, sub))
    return runs


SERVICE_IMAGE = DOCKER / "Dockerfile"
VLLM_IMAGE = DOCKER / "vllm-cpu.Dockerfile"
FOREIGN_ENV_IMAGE = DOCKER / "foreign-env.Dockerfile"


def image_commands() -> dict[Path, set[tuple[str, str]]]:
    """What each image is run as: its own entrypoint, and (the service's image) what compose and docker/e2e.sh
    run in it."""
    runs = compose_commands()
    commands: dict[Path, set[tuple[str, str]]] = {}
    for image in (SERVICE_IMAGE, VLLM_IMAGE, FOREIGN_ENV_IMAGE):
        words = entrypoint(image)
        if image == FOREIGN_ENV_IMAGE:  # a foreign image's own program, its arguments from its CMD
            words = [Path(words[0]).name, *[w for w in (json.loads(dict(dockerfile_instructions(image))["CMD"]))]]
        commands[image] = {(words[0], words[1])} if words[1] != "--help" else set()
    commands[SERVICE_IMAGE] |= runs["rollout-service:local"]
    # docker/e2e.sh runs the load test in the service's container (a quoted command after `exec ... service`).
    e2e = (DOCKER / "e2e.sh").read_text()
    commands[SERVICE_IMAGE] |= {("rollout-service", sub) for sub in re.findall(r"'rollout-service ([a-z-]+)", e2e)}
    return commands


# The program a console script runs, and the module each program's commands are handled in.
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]

# Run in the fresh environment: a command's --help, then every module it loads (see the module's docstring).
PROBE = r"""
import ast, importlib, importlib.util, sys
SCRIPTS = {SCRIPTS}
pairs = [a for a in sys.argv[1:] if ":" in a]
extra = [a for a in sys.argv[1:] if ":" not in a]
OURS = ("rollout_service", "inference", "refenv")

def imports_in(node, package):
    # Module names an AST node imports, outside `if TYPE_CHECKING:` and `try: ... except ImportError`.
    found = []
    def visit(n, guarded):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            return
        if isinstance(n, ast.Try) and any("ImportError" in ast.unparse(h.type or ast.Name("")) for h in n.handlers):
            guarded = True
        if isinstance(n, ast.Import) and not guarded:
            found.extend(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and not guarded:
            base = importlib.util.resolve_name("." * n.level + (n.module or ""), package) if n.level else n.module
            for a in n.names:  # `from pkg import mod` imports a module when that is one
                full = f"{base}.{a.name}"
                found.append(full if importlib.util.find_spec(base) and _is_module(full) else base)
        for child in ast.iter_child_nodes(n):
            visit(child, guarded)
    visit(node, False)
    return found

def _is_module(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False

def source_of(module):
    # Its syntax tree and the package its relative imports start from (None for a module without source).
    spec = importlib.util.find_spec(module)
    if not (spec and spec.origin and spec.origin.endswith(".py")):
        return None, None
    package = module if spec.submodule_search_locations is not None else module.rpartition(".")[0]
    return ast.parse(open(spec.origin).read()), package

todo, done = list(extra), set()
for pair in pairs:
    script, sub = pair.split(":")
    module_name, func = SCRIPTS[script].split(":")
    main = getattr(importlib.import_module(module_name), func)
    try:
        main([sub, "--help"])
    except SystemExit as exc:
        assert exc.code in (0, None), f"{script} {sub} --help exited {exc.code}"
    cli = importlib.import_module(module_name)
    tree = ast.parse(open(cli.__file__).read())
    package = module_name.rpartition(".")[0]
    if hasattr(cli, "COMMANDS"):  # rollout-service: the chosen command's flags and handler
        names = {f.__name__ for f in cli.COMMANDS[sub][1:]}
        todo += [i for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in names
                 for i in imports_in(n, package)]
    else:  # refenv: one small CLI, every command's imports
        todo += imports_in(tree, package)
    done.add(module_name)  # its other commands' imports are theirs
while todo:
    name = todo.pop()
    if name in done:
        continue
    done.add(name)
    importlib.import_module(name)
    if name.split(".")[0] in OURS:
        tree, package = source_of(name)
        if tree is not None:
            todo += imports_in(tree, package)
print(len(done), "modules imported")
"""


def _probe(python: Path, runs: set[tuple[str, str]], extra: list[str]) -> subprocess.CompletedProcess:
    """Every command of one image in one process: its --help, then the modules it loads (PROBE)."""
    code = PROBE.replace("{SCRIPTS}", repr(SCRIPTS))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return subprocess.run(
        [python, "-c", code, *(f"{p}:{c}" for p, c in sorted(runs)), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd="/",
    )


# What the vLLM image runs beyond its entrypoint's own code: the server the launcher execs, and the plugin
# vLLM loads in each of its processes (pyproject.toml's vllm.general_plugins).
VLLM_RUNS = ["vllm.entrypoints.openai.api_server", "rollout_service.launch.vllm_plugin"]


@pytest.fixture(scope="module")
def commands() -> dict[Path, set[tuple[str, str]]]:
    return image_commands()


@pytest.mark.parametrize("image", [SERVICE_IMAGE, VLLM_IMAGE, FOREIGN_ENV_IMAGE], ids=lambda p: p.name)
def test_image_holds_what_its_commands_import(image, commands, tmp_path):
    runs = commands[image]
    assert runs, f"{image.name}: no command found to check"
    dists = closure(pip_installs(image))
    assert PROJECT in dists, f"{image.name} does not install the project"
    python = make_venv(tmp_path / "venv", dists)
    done = _probe(python, runs, VLLM_RUNS if image == VLLM_IMAGE else [])
    assert done.returncode == 0, (
        f"{image.name}: {sorted(runs)} fail with only what the image installs "
        f"({', '.join(sorted(dists))[:400]}...):\n{done.stderr[-3000:]}"
    )


def test_the_commands_found_are_the_ones_the_images_run(commands):
    """The check above covers each image's entrypoint and what compose runs in the service's image; a command
    no table names would go unchecked."""
    assert commands[VLLM_IMAGE] == {("rollout-service", "vllm")}
    assert commands[FOREIGN_ENV_IMAGE] == {("refenv", "serve")}
    assert {
        ("rollout-service", "serve"),
        ("refenv", "serve"),
        ("rollout-service", "keys"),
        ("rollout-service", "vllm-key"),
        ("rollout-service", "loadtest"),
    } <= commands[SERVICE_IMAGE]


def test_the_vllm_image_installs_the_launchers_extra_only():
    """The launcher's image installs the project with the `vllm` extra, not the service's `server` one: what
    it runs loads nothing of the service (the check above would pass with the server extra there too)."""
    projects = [r for reqs, _ in pip_installs(VLLM_IMAGE) for r in reqs if r.startswith(PROJECT)]
    assert projects == [f"{PROJECT}[vllm]"], projects
