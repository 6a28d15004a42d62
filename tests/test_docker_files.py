"""The Docker files: the compose files parse with a compose validator, the Dockerfiles pass hadolint.

`docker/e2e.sh` runs the CPU stack for real under a Docker engine (by hand: it needs root and an
engine); here the files are checked without one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parents[1] / "docker"


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed (make test installs it)")
        pytest.skip(f"{name} is not installed here (make test installs it where it can)")
    return found


@pytest.mark.parametrize("compose", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_files_validate(compose):
    done = subprocess.run(
        [_tool("docker-compose"), "-f", str(DOCKER / compose), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=DOCKER,
    )
    assert done.returncode == 0, done.stderr
    config = done.stdout
    assert "127.0.0.1:8080:8080" in config  # published to this machine only by default
    assert "condition: service_healthy" in config
    assert "${" not in config, "a variable the validator could not resolve (nested defaults are not portable)"


def test_dockerfiles_pass_hadolint():
    files = sorted(str(p) for p in DOCKER.glob("*Dockerfile"))
    assert len(files) == 2
    done = subprocess.run([_tool("hadolint"), *files], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_images_run_as_non_root():
    for dockerfile in DOCKER.glob("*Dockerfile"):
        users = [line.split()[1] for line in dockerfile.read_text().splitlines() if line.startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), dockerfile
