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
import yaml

DOCKER = Path(__file__).resolve().parents[1] / "docker"


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed (make test installs it)")
        pytest.skip(f"{name} is not installed here (make test installs it where it can)")
    return found


def _config(*files: str, **env: str) -> dict:
    """The compose file(s) as docker-compose resolves them with these variables set."""
    done = subprocess.run(
        [_tool("docker-compose"), *(a for f in files for a in ("-f", str(DOCKER / f))), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=DOCKER,
        env={k: v for k, v in os.environ.items() if not k.startswith(("ENV_", "COMPOSE_"))} | env,
    )
    assert done.returncode == 0, done.stderr
    assert "${" not in done.stdout, "a variable the validator could not resolve (nested defaults are not portable)"
    return yaml.safe_load(done.stdout)


def _assert_env_needs_nothing_inside(config: dict) -> None:
    """Nothing waits on a check that runs inside the env's image, and no build is tagged with its name."""
    env = config["services"]["env"]
    assert "build" not in env and "healthcheck" not in env, env
    for name, service in config["services"].items():
        depends_on = service.get("depends_on") or {}
        conditions = [d.get("condition") for d in depends_on.values()] if isinstance(depends_on, dict) else []
        assert "service_healthy" not in conditions, (name, depends_on)
    built = {s["image"] for s in config["services"].values() if "build" in s}
    assert env["image"] not in built or env["image"] == "rollout-service:local", built


@pytest.mark.parametrize("compose", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_files_validate(compose):
    config = _config(compose)
    services = config["services"]
    assert "127.0.0.1:8080:8080" in str(services["service"]["ports"])  # this machine only by default
    # The default env is refenv in this repo's image, built once, by the service, under its own name.
    env = services["env"]
    assert env["image"] == "rollout-service:local" == services["service"]["image"]
    assert "entrypoint" not in env and str(env["command"]).startswith("refenv serve --step")
    assert services["service"]["command"][:2] == ["rollout-service", "serve"]
    # The service waits for the env and model server itself, long enough for vLLM to load.
    command = services["service"]["command"]
    assert float(command[command.index("--startup-timeout") + 1]) >= 1800
    # It listens on 0.0.0.0 in its network: it starts only keyed, with the keys the keys step wrote
    # (generated where none are set) into the host folder the trainer reads and the service's volume.
    assert command[command.index("--api-key-env") + 1] == "ROLLOUT_API_KEY"
    assert command[command.index("--admin-key-env") + 1] == "ROLLOUT_ADMIN_KEY"
    assert "/service-keys/rollout.keys" in " ".join(services["service"]["entrypoint"])
    assert services["service"]["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    keys = services["keys"]
    assert "rollout-service keys /keys/rollout.keys" in " ".join(keys["command"])
    assert any("docker/keys:/keys" in str(v) for v in keys["volumes"]), keys["volumes"]
    assert (DOCKER / "keys" / ".gitignore").is_file()  # the folder exists in a clone, owned by its user
    _assert_env_needs_nothing_inside(config)


@pytest.mark.parametrize("compose", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_closes_the_env_by_default_with_a_token_it_generates(compose):
    """With no ENV_TOKEN set, the env still answers only the service: the keys step writes a token
    once (`rollout-service env-token`, ENV_TOKEN where set), the env reads it from a file, the service
    from the same volume; nothing gives the env an empty token (refenv then asks for none). Checked on
    the files as compose resolves them (no Docker engine here); the pieces themselves run in
    tests/test_security.py. Break tried: the old files (REFENV_TOKEN: ${ENV_TOKEN:-}) -> the env got an
    empty token and no file, fails."""
    for given in ({}, {"ENV_TOKEN": "an-operator-chosen-token"}):
        services = _config(compose, **given)["services"]
        env, keys, service = services["env"], services["keys"], services["service"]
        assert "REFENV_TOKEN" not in env.get("environment", {}), env.get("environment")
        assert env["environment"]["REFENV_TOKEN_FILE"] == "/env-token/token"
        assert "env-token:/env-token:ro" in " ".join(str(v) for v in env["volumes"]), env["volumes"]
        assert env["depends_on"]["keys"]["condition"] == "service_completed_successfully"
        step = " ".join(keys["command"])
        assert "rollout-service env-token /env-token/token" in step and "chown 10001" in step, step
        assert keys["environment"]["ENV_TOKEN"] == given.get("ENV_TOKEN", ""), keys["environment"]
        assert "env-token:/env-token" in " ".join(str(v) for v in keys["volumes"])
        assert ". /env-token/token.env" in " ".join(service["entrypoint"]), service["entrypoint"]
        assert "env-token:/env-token:ro" in " ".join(str(v) for v in service["volumes"])
        command = service["command"]
        assert command[command.index("--env-token-env") + 1] == "ENV_TOKEN"
        assert "ENV_TOKEN" not in (service.get("environment") or {}), "the file's token, not an empty variable"


@pytest.mark.parametrize("compose", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_keys_vllm_and_lets_any_env_user_read_its_token(compose):
    """vLLM requires the key the keys step writes (from $VLLM_API_KEY, never its command line) and the service
    sends it; the env's token file is readable by an env image's own user (issue 46: uid 10002 could not).
    docker/e2e.sh checks both on a running stack. Breaks tried: the keys step without `chmod 0444
    /env-token/token`, and the vLLM entry without the key's volume, each fails here."""
    for given in ({}, {"VLLM_API_KEY": "an-operator-chosen-vllm-key"}):
        services = _config(compose, **given)["services"]
        vllm, keys, service = services["vllm"], services["keys"], services["service"]
        step = " ".join(keys["command"])
        assert "rollout-service vllm-key /vllm-key/key" in step and "chmod 0444 /vllm-key/key" in step, step
        assert "chmod 0444 /env-token/token" in step, step
        assert keys["environment"]["VLLM_API_KEY"] == given.get("VLLM_API_KEY", ""), keys["environment"]
        assert "vllm-key:/vllm-key:ro" in " ".join(str(v) for v in vllm["volumes"]), vllm["volumes"]
        assert vllm["depends_on"]["keys"]["condition"] == "service_completed_successfully"
        how = " ".join(vllm.get("entrypoint") or []) + " " + " ".join(vllm.get("command") or [])
        assert "--api-key-file /vllm-key/key" in how or ". /vllm-key/key.env" in how, how
        assert "--api-key " not in how, "the key would show on vLLM's command line"
        assert "/v1/" not in " ".join(vllm["healthcheck"]["test"]), "its health check would need the key"
        assert ". /vllm-key/key.env" in " ".join(service["entrypoint"]), service["entrypoint"]
        command = service["command"]
        assert command[command.index("--vllm-api-key-env") + 1] == "VLLM_API_KEY"


@pytest.mark.parametrize("compose", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_runs_a_foreign_env_image_as_it_intends(compose):
    """GraphJin's image: its own entrypoint (`graphjin`), ENV_COMMAND as its arguments, its project
    mounted at /data, no health-check tooling inside."""
    args = "env serve --path /data/project --suite eval/suite.yml --pool 16 --step --side train --listen 0.0.0.0:8090"
    config = _config(compose, ENV_IMAGE="dosco/graphjin", ENV_COMMAND=args, ENV_DATA="/srv/graphjin-project")
    env = config["services"]["env"]
    assert env["image"] == "dosco/graphjin"
    assert "entrypoint" not in env  # the image's own
    assert env["command"] == args or env["command"] == args.split()
    assert any(str(v).startswith("/srv/graphjin-project:/data") for v in env["volumes"]), env["volumes"]
    _assert_env_needs_nothing_inside(config)
    # Another entrypoint only when asked for, through the override file.
    config = _config(compose, "compose.entrypoint.yaml", ENV_IMAGE="some/env", ENV_ENTRYPOINT="/opt/env/bin/serve")
    assert config["services"]["env"]["entrypoint"] in ("/opt/env/bin/serve", ["/opt/env/bin/serve"])


def test_dockerfiles_pass_hadolint():
    files = sorted(str(p) for p in DOCKER.glob("*Dockerfile"))
    assert len(files) == 3  # the service/refenv image, vLLM's CPU image, the foreign-style env image
    done = subprocess.run([_tool("hadolint"), *files], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_images_run_as_non_root():
    for dockerfile in DOCKER.glob("*Dockerfile"):
        users = [line.split()[1] for line in dockerfile.read_text().splitlines() if line.startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), dockerfile
