"""The docs site says what the code does, and builds: every flag and every route is on the pages
generated from the code (checked against the parsers and the app's routes, not against the
generator's own reading), every failure kind is documented with its attribution, every benchmark
figure comes from a complete record, and `mkdocs build --strict` passes (and fails on a broken link)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.routing import APIRoute

from refenv import cli as refenv_cli
from rollout_service.protocol import FAILURE_KINDS, attribution_of
from rollout_service.server.config import ServiceConfig
from rollout_service.server.http.app import create_app
from rollout_service.tools import cli as service_cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """The generated parts of the site, as `make docs` writes them, into a folder of the test's own."""
    out = tmp_path_factory.mktemp("generated")
    for script in ("scripts/gen_docs.py", "bench/render.py"):
        subprocess.run([sys.executable, script, "--out", str(out)], cwd=ROOT, check=True, timeout=120)
    return out


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [(f"{prefix} {name}", sub), *_commands(sub, f"{prefix} {name}")]
    return found


def _section(page: str, heading: str) -> str:
    start = page.index(heading)
    following = page.find("\n### ", start + len(heading))
    return page[start : following if following != -1 else None]


@pytest.mark.parametrize(
    "program,build", [("rollout-service", service_cli.build_parser), ("refenv", refenv_cli.build_parser)]
)
def test_every_flag_of_every_command_is_on_the_configuration_page(generated, program, build):
    page = (generated / "configuration.md").read_text()
    for command, parser in _commands(build(), program):
        flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
        if not flags:
            continue
        section = _section(page, f"### `{command}`")
        missing = [f for f in flags if not re.search(rf"`{re.escape(f)}[ `]", section)]
        assert not missing, f"{command}: {missing} not on the configuration page"


def test_every_field_of_the_ray_deployments_file_is_on_the_configuration_page(generated):
    from rollout_service.cluster.config import ClusterConfig

    page = (generated / "configuration.md").read_text()
    models = [ClusterConfig, *(info.annotation for info in ClusterConfig.model_fields.values())]
    for model in models:
        if isinstance(model, type) and hasattr(model, "model_fields"):
            anchor = f'<a id="schema-{model.__name__.lower()}">'
            assert anchor in page, f"{model.__name__} has no table on the configuration page"
            section = page[page.index(anchor) :]
            missing = [name for name in model.model_fields if f"| `{name}` |" not in section.split("<a id=", 2)[1]]
            assert not missing, f"{model.__name__}: {missing}"


def test_every_route_is_on_the_http_api_page(generated):
    page = (generated / "http-api.md").read_text()
    app = create_app(ServiceConfig(env=["http://127.0.0.1:9"], vllm=["http://127.0.0.1:9"], model="m"))
    routes = [(method, r.path) for r in app.routes if isinstance(r, APIRoute) for method in r.methods]
    assert len(routes) >= 16  # every route the service has, not a subset the router happens to hold
    missing = [f"{m} {p}" for m, p in routes if f"### `{m} {p}`" not in page]
    assert not missing, f"not on the HTTP API page: {missing}"
    for field in ServiceConfig.model_fields:  # nothing of the settings leaks in; a sanity check of the oracle
        assert f"`--{field.replace('_', '-')}`" not in page


def test_every_request_field_is_on_the_http_api_page(generated):
    from rollout_service.protocol import GroupRequest

    page = (generated / "http-api.md").read_text()
    section = page[page.index('<a id="schema-grouprequest">') :]
    section = section[: section.index("<a id=", 10)]
    missing = [name for name, info in GroupRequest.model_fields.items() if f"| `{info.alias or name}` |" not in section]
    assert not missing, missing


def test_every_failure_kind_is_documented_with_its_attribution():
    page = (DOCS / "concepts.md").read_text()
    for kind in FAILURE_KINDS:
        attribution = attribution_of(kind)
        row = next((line for line in page.splitlines() if line.startswith(f"| `{kind}` |")), None)
        assert row is not None, f"docs/concepts.md does not list failure kind {kind}"
        assert f"| {attribution} |" in row, row


def test_every_benchmark_record_is_complete_and_on_the_benchmarks_page(generated):
    page = (DOCS / "benchmarks.md").read_text()
    records = [
        p for p in sorted((ROOT / "bench" / "results").glob("*.json")) if "benchmark" in json.loads(p.read_text())
    ]
    assert len(records) >= 20  # the carried-over ones at least
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from record import normalize
    finally:
        sys.path.remove(str(ROOT / "bench"))
    for path in records:
        record = normalize(json.loads(path.read_text()))
        for key in ("benchmark", "title", "command", "commit", "machine", "date", "figures"):
            assert record.get(key), f"{path.name}: no {key}"
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", record["date"]), path.name
        assert record["figures"]["rows"], path.name
        include = f'--8<-- "bench-{record["benchmark"]}.md"'
        assert include in page, f"{path.name}: benchmark {record['benchmark']} is not on docs/benchmarks.md"
        rendered = (generated / f"bench-{record['benchmark']}.md").read_text()
        history = generated / f"bench-{record['benchmark']}-history.md"
        if history.exists():  # a benchmark measured again as the code changed: each record in one table
            assert f'--8<-- "{history.name}"' in page
            assert f"`{record['commit']}` {record['date']}: {record['title']} (`bench/results/{path.name}`)" in (
                history.read_text()
            )
        else:
            assert f"`{record['command']}` · commit `{record['commit']}` · {record['date']}" in rendered
            assert path.name in rendered


def test_the_generated_tables_are_committed_and_current(generated):
    """The pages include docs/generated/: committed, so that the tables read where the pages are read
    (a clone, the forge's file view), and what the generators write now. Compared with git's index,
    not the working tree: `make test` runs `make docs` first, which rewrites the working tree's copy."""
    fresh = sorted(p.name for p in generated.iterdir())
    listed = subprocess.run(["git", "ls-files", "docs/generated"], cwd=ROOT, capture_output=True, text=True)
    assert sorted(Path(line).name for line in listed.stdout.split()) == fresh, (
        "docs/generated/ holds other files than the generators write: run `make docs` and commit docs/generated/"
    )
    stale = [
        name
        for name in fresh
        if subprocess.run(["git", "show", f":docs/generated/{name}"], cwd=ROOT, capture_output=True, text=True).stdout
        != (generated / name).read_text()
    ]
    assert not stale, f"docs/generated/ as committed is not what `make docs` writes now: {stale}; commit them"


def _site_copy(tmp_path: Path, generated: Path) -> Path:
    site = tmp_path / "project"
    shutil.copytree(DOCS, site / "docs", ignore=shutil.ignore_patterns("generated"))
    shutil.copytree(generated, site / "docs" / "generated")
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / name, site / name)
    return site


def _build(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site / "site")],
        cwd=site, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


def test_the_site_builds_strict_and_a_broken_link_fails_it(tmp_path, generated):
    site = _site_copy(tmp_path, generated)
    built = _build(site)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (site / "site" / "http-api" / "index.html").exists()
    # The build is strict indeed: one link to a missing anchor fails it.
    page = site / "docs" / "guarantees.md"
    page.write_text(page.read_text() + "\n[nowhere](benchmarks.md#no-such-section)\n")
    broken = _build(site)
    assert broken.returncode != 0 and "no-such-section" in broken.stderr


def test_the_readme_links_to_files_that_exist_and_carries_no_dates_or_commits():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme), "a date in the README: keep it in a record or the changelog"
    assert not re.search(r"\b[0-9a-f]{7,40}\b", readme), "a commit hash in the README"
    assert not re.search(r"\b\d\d:\d\d(–|-)\d\d:\d\d\b", readme), "a run window in the README"


def test_every_figure_of_the_readme_says_which_state_of_the_project_measured_it():
    """No figure passes for a measurement of the code as it is now unless it is one: each row of the
    README's measured table names the state that made it, and links to the page with its record."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Measured") : readme.index("## Documentation")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) >= 10
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 3 and cells[2], f"a README figure without the state that measured it: {row}"
        assert "](docs/benchmarks" in cells[1], f"a README figure without its record: {row}"


def test_a_record_a_benchmark_writes_is_rendered_with_its_provenance(tmp_path):
    """bench/record.py as bench/compare.py --record uses it: nested results flattened into a row, the
    command as typed, this checkout's commit and this machine; bench/render.py shows all of it."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import record
        import render
    finally:
        sys.path.remove(str(ROOT / "bench"))
    row = record.flat({"groups_per_s": 0.3, "pool": {"busy": 0.87, "max_held": 8}})
    assert row == {"groups_per_s": 0.3, "pool.busy": 0.87, "pool.max_held": 8}
    made = record.make("naive", "Against the naive driver", [row], argv=[str(ROOT / "bench/compare.py"), "naive"])
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert made["command"] == "bench/compare.py naive"
    assert made["commit"].removesuffix("+dirty") == head.stdout.strip()
    assert made["machine"]["cpus"] == os.cpu_count()
    record.write(made, tmp_path / "naive.json")
    (page,) = render.render(record.load_all(tmp_path)).values()
    assert f"`bench/compare.py naive` · commit `{made['commit']}` · {made['date']}" in page
    assert "| groups per s | pool.busy | pool.max held |" in page and "| 0.3 | 0.87 | 8 |" in page
    with pytest.raises(ValueError, match="missing commit"):
        record.check({k: v for k, v in made.items() if k != "commit"})
