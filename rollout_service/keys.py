"""The service's two keys in one file: written once (compose, `ray up`), read by the trainer.

The file is environment-variable lines, so a shell (`set -a; . FILE`) and the service's
`--api-key-env ROLLOUT_API_KEY --admin-key-env ROLLOUT_ADMIN_KEY` read it as they are:

    ROLLOUT_API_KEY=...      the data plane's key (trainers)
    ROLLOUT_ADMIN_KEY=...    the admin plane's key (operators: membership, policy updates)

The env's token (refenv --token) is kept apart (`ensure_env_token`): the envs and the service hold
it, the trainer does not. So is the model servers' key (`ensure_vllm_key`, vLLM's `--api-key`): the
model servers and the service hold it.

It is created with mode 0600 (owner only), never through a symlink. Keys generated once stay the
keys: a file that exists is replaced only by keys the operator chose (both variables set).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

API_KEY_VAR = "ROLLOUT_API_KEY"
ADMIN_KEY_VAR = "ROLLOUT_ADMIN_KEY"


def read_key_file(path: str | Path) -> dict[str, str]:
    """The variables the file sets (comments and blank lines skipped)."""
    values: dict[str, str] = {}
    for line in Path(path).expanduser().read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if sep:
            values[name.strip().removeprefix("export ").strip()] = value.strip().strip("'\"")
    return values


def ensure_key_file(path: str | Path, given: Mapping[str, str] | None = None) -> Path:
    """Make `path` hold the two keys; its path. The keys: `given`'s ROLLOUT_API_KEY and
    ROLLOUT_ADMIN_KEY when both are set there (written even over an existing file: the operator
    chose them), else fresh random ones, written only if the file does not exist yet.

    Its folder is made 0700 if missing. When run as root (a container's key step writing into a host
    folder), the file is given to that folder's owner: the trainer on the host reads it as itself."""
    path = Path(path).expanduser()
    if path.is_symlink():
        raise ValueError(f"{path} is a symlink: the key file is written only where it is named")
    chosen = {var: (given or {}).get(var, "") for var in (API_KEY_VAR, ADMIN_KEY_VAR)}
    if path.exists() and not all(chosen.values()):
        return path
    if not all(chosen.values()):
        chosen = {var: secrets.token_urlsafe(32) for var in chosen}
    text = "# rollout-service keys (docs/security.md): keep this file private\n" + "".join(
        f"{var}={key}\n" for var, key in chosen.items()
    )
    _write_private(path, text)
    return path


ENV_TOKEN_VAR = "ENV_TOKEN"
# What a token given in ENV_TOKEN may hold: it is written into a file a shell reads as a variable.
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}")


def ensure_env_token(path: str | Path, given: Mapping[str, str] | None = None) -> Path:
    """Make `path` hold the env's token (its one line: refenv --token-file reads it) and
    `<path>.env` the line `ENV_TOKEN=...` (the service's --env-token-env reads it once a shell has
    read that file). The token: `given`'s ENV_TOKEN when set (written even over existing files),
    else a fresh random one, written only if `path` does not exist yet. ValueError for an ENV_TOKEN
    that is too short or holds characters a shell would read otherwise."""
    return _ensure_secret(path, ENV_TOKEN_VAR, given)


# The variable vLLM reads its API key from (so it never shows on its command line) and the one the
# service is told of (--vllm-api-key-env VLLM_API_KEY).
VLLM_KEY_VAR = "VLLM_API_KEY"


def ensure_vllm_key(path: str | Path, given: Mapping[str, str] | None = None) -> Path:
    """As `ensure_env_token`, for the key the model servers require (vLLM's `--api-key`, read from
    $VLLM_API_KEY): `path` holds it, `<path>.env` the line `VLLM_API_KEY=...`."""
    return _ensure_secret(path, VLLM_KEY_VAR, given)


def _ensure_secret(path: str | Path, var: str, given: Mapping[str, str] | None) -> Path:
    path = Path(path).expanduser()
    shell_file = path.with_name(path.name + ".env")
    for file in (path, shell_file):
        if file.is_symlink():
            raise ValueError(f"{file} is a symlink: the secret is written only where it is named")
    chosen = (given or {}).get(var, "")
    if chosen and not _TOKEN.fullmatch(chosen):
        raise ValueError(f"{var} must be 16 to 512 characters of letters, digits and ._~+/=- (it is not shown here)")
    if not chosen:
        if path.exists() and shell_file.exists():
            return path
        chosen = secrets.token_urlsafe(32)
    _write_private(path, chosen + "\n")
    _write_private(shell_file, f"{var}={chosen}\n")
    return path


def _write_private(path: Path, text: str) -> None:
    """`text` as `path`, mode 0600, in a folder made 0700 if missing. When run as root (a container's
    key step writing into a host folder), the file is given to that folder's owner."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Written beside it and renamed over: a reader never sees half a file, and a link planted at the
    # temporary name is refused (O_EXCL | O_NOFOLLOW).
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        folder = path.parent.stat()
        if os.geteuid() == 0 and folder.st_uid != 0:
            with contextlib.suppress(OSError):
                os.chown(temporary, folder.st_uid, folder.st_gid)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def client_keys(
    api_key: str | None, admin_key: str | None, key_file: str | Path | None, environ: Mapping[str, str] | None = None
) -> tuple[str | None, str | None]:
    """The keys a client sends: those given, else the key file's, else $ROLLOUT_API_KEY and
    $ROLLOUT_ADMIN_KEY. The admin key defaults to the API key (one key may serve both)."""
    environ = os.environ if environ is None else environ
    source: Mapping[str, str] = read_key_file(key_file) if key_file is not None else environ
    api_key = api_key or source.get(API_KEY_VAR) or None
    admin_key = admin_key or source.get(ADMIN_KEY_VAR) or None
    return api_key, admin_key or api_key
