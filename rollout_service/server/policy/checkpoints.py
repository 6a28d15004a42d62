"""Whether a folder named by POST /policy is a checkpoint the model servers can load, asked before
any replica is paused or reloaded."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from ..errors import Invalid

# What a folder must hold to be loaded: vLLM's full checkpoint, or a PEFT adapter.
CHECKPOINT_CONFIG = {"weights": "config.json", "lora": "adapter_config.json"}


def check_checkpoint(path: str, kind: Literal["weights", "lora"], root: str | None = None) -> str:
    """The folder, its links resolved (what the replicas are told to load), or Invalid for a folder
    vLLM could not load, before any replica is paused. vLLM 0.32 reloads in place, and a reload that
    fails (a missing folder, no weights in it) leaves the replica broken until it restarts; so the
    folder must be visible to the service too (the same machine or shared storage) and hold its
    config and safetensors weights. With `root` (--checkpoint-root), the folder and every entry in it,
    at any depth (whatever the engine reads: weights in any format, configs, tokenizer files), must be
    under it once symlinks are resolved.

    One answer for every refusal: which folders exist on this host is none of the caller's business."""
    real = _readable_checkpoint(path, CHECKPOINT_CONFIG[kind], root)
    if real is None:
        under = " under the checkpoint root" if root else ""
        raise Invalid(
            "checkpoint_refused",
            f"{path[:200]!r} is not a readable checkpoint{under}: give the absolute path of a folder the service "
            f"and the model servers both read, holding {CHECKPOINT_CONFIG[kind]} and *.safetensors weights",
        )
    return str(real)


# A checkpoint folder holds a config, weights (sharded: a few hundred files) and tokenizer files; a
# folder with more entries than this is not walked (the check runs on every update) but refused.
_MAX_CHECKPOINT_ENTRIES = 10_000


def _readable_checkpoint(path: str, config_name: str, root: str | None) -> Path | None:
    try:
        folder = Path(path)
        if not folder.is_absolute():  # the model servers would resolve it against their own directory
            return None
        real = folder.resolve(strict=True)
        bound = Path(root).resolve(strict=True) if root else None

        def inside(target: Path) -> bool:
            resolved = target.resolve(strict=True)
            return bound is None or resolved == bound or resolved.is_relative_to(bound)

        def readable(target: Path, mode: int) -> bool:
            return inside(target) and os.access(target.resolve(strict=True), mode)

        if not real.is_dir() or not readable(real, os.R_OK | os.X_OK):
            return None
        config = real / config_name
        if not config.is_file() or not readable(config, os.R_OK):
            return None
        weights = [f for f in real.glob("*.safetensors") if f.is_file()]
        if not weights or not all(readable(f, os.R_OK) for f in weights):
            return None
        if bound is not None and not _entries_inside(real, inside):
            return None
        return real
    except (OSError, ValueError, RuntimeError):  # missing, a loop of links, a name the file system refuses
        return None


def _entries_inside(folder: Path, inside: Callable[[Path], bool]) -> bool:
    """Every entry under `folder`, at any depth, resolves inside the root: a link anywhere in it that
    leaves the root (a *.bin, a tokenizer file, a linked sub-folder) refuses the folder. A linked
    folder that stays inside the root is walked into as well (the engine reads through it), each real
    folder once (a loop of links ends)."""
    seen = 0
    walked = {folder.resolve(strict=True)}
    for top, folders, files in os.walk(folder, followlinks=True, onerror=_raise):
        for name in (*folders, *files):
            seen += 1
            if seen > _MAX_CHECKPOINT_ENTRIES or not inside(Path(top) / name):
                return False
        unwalked = []
        for name in folders:
            real = (Path(top) / name).resolve(strict=True)
            if real not in walked:
                walked.add(real)
                unwalked.append(name)
        folders[:] = unwalked
    return True


def _raise(error: OSError) -> None:
    raise error
