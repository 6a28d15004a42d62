"""Command-line flags and environment variables generated from one settings model.

Each setting is a field of a pydantic model, defined once: its type, default, bounds and help.
From it come the `--flag` (the field name in kebab case), the environment variable (a prefix and
the field name in upper case), the `--help` text and the docs' configuration tables. A value
is taken from the command line if given there (falsy values included), else from the
environment, else the model's default; the model then validates it, so a bad value reads as
one line naming the flag.

Why not pydantic-settings' own CLI source (`CliSettingsSource`), which reads flags and variables from
a model too: asked the same things (tests/test_layout.py keeps asking), it refuses a list given in one
variable as `a,b` (it wants JSON there), and a bad value comes back as pydantic's multi-line report
naming the field (`max_n`), not the flag and variable a person typed; both would need a layer like
this one on top of it.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class Flag:
    """How a setting appears on the command line: `Annotated[T, Flag(...)]` on the field."""

    metavar: str | None = None
    separator: str = ","  # between the items of a list given in one environment variable
    env: bool = True  # False: a flag only, no environment variable
    default_text: str | None = None  # what --help and the docs say the default is, when not the value


_M = TypeVar("_M", bound=BaseModel)


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names its flag and variable."""


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` (a setting's value) as (host, port); an empty host means loopback, port 0 a port
    the system picks as the server binds it (written to --port-file)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def _valid_listen(text: str) -> str:
    parse_listen(text)
    return text


# A `HOST:PORT` setting, checked when the settings are read.
ListenAddress = Annotated[str, AfterValidator(_valid_listen), Flag(metavar="HOST:PORT")]


def _valid_port_file(path: str | None) -> str | None:
    # Checked when the settings are read: written only once the server listens, a file in no folder
    # would otherwise fail after the whole start-up.
    if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"{path!r}: its folder does not exist")
    return path


# Where a server writes the port it listens on, once it does (rollout_service/listening.py).
PortFile = Annotated[str | None, AfterValidator(_valid_port_file), Flag(metavar="PATH")]
PORT_FILE_HELP = (
    "once listening, write the port to PATH (one line, replaced in one rename): with --listen HOST:0 the "
    "system picks the port, and a launcher reads it here"
)


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(prefix: str, field: str) -> str:
    return prefix + field.upper()


def _meta(info: FieldInfo) -> Flag:
    return next((m for m in info.metadata if isinstance(m, Flag)), Flag())


def _is_list(info: FieldInfo) -> bool:
    annotation = info.annotation
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return any(typing.get_origin(a) is list for a in args)


def _is_bool(info: FieldInfo) -> bool:
    return info.annotation is bool


def _default_text(info: FieldInfo, meta: Flag) -> str:
    if meta.default_text is not None:
        return meta.default_text
    if info.is_required():
        return "required"
    default = info.get_default(call_default_factory=True)
    if default is None or default == [] or default is PydanticUndefined:
        return "none"
    if isinstance(default, list):
        return ",".join(str(d) for d in default)
    return str(default).lower() if isinstance(default, bool) else str(default)


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], env_prefix: str) -> None:
    """One flag per field of `model`; every default is None so that "not given" can be told apart."""
    for name, info in model.model_fields.items():
        meta = _meta(info)
        env = f" [{env_name(env_prefix, name)}]" if meta.env else ""
        default = "required" if info.is_required() else f"default {_default_text(info, meta)}"
        help_text = f"{info.description or ''} ({default}){env}".replace("%", "%%")
        if _is_bool(info):
            parser.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif _is_list(info):
            parser.add_argument(
                flag_name(name), action="append", default=None, metavar=meta.metavar, help=help_text + " (repeatable)"
            )
        else:
            parser.add_argument(flag_name(name), default=None, metavar=meta.metavar, help=help_text)


def settings_from(
    args: argparse.Namespace,
    model: type[_M],
    env_prefix: str,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> _M:
    """The settings: the command line, else the environment, else the defaults; validated."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        meta = _meta(info)
        given = getattr(args, name, None)
        if given is None and meta.env:
            raw = environ.get(env_name(env_prefix, name))
            if raw is not None and raw != "":
                given = [v.strip() for v in raw.split(meta.separator) if v.strip()] if _is_list(info) else raw
        if given is not None:
            values[name] = given
    values.update(overrides)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise SettingsError(describe(exc, env_prefix, model)) from None


def describe(exc: ValidationError, env_prefix: str, model: type[BaseModel]) -> str:
    """A validation error as one line per setting, named by its flag and variable."""
    parts = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error.get("loc") else ""
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        if field in model.model_fields:
            env = f" ({env_name(env_prefix, field)})" if _meta(model.model_fields[field]).env else ""
            if error.get("type") == "missing":
                message = "missing"
            parts.append(f"{flag_name(field)}{env}: {message}")
        else:
            parts.append(message)
    return "; ".join(parts)


def markdown_table(model: type[BaseModel], env_prefix: str) -> str:
    """The configuration table of `model` (docs/configuration.md is made of these)."""
    rows = ["| flag | env var | default | meaning |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        meta = _meta(info)
        flag = (
            flag_name(name) + (f" {meta.metavar}" if meta.metavar else "") + (" (repeatable)" if _is_list(info) else "")
        )
        env = f"`{env_name(env_prefix, name)}`" if meta.env else "-"
        if meta.env and _is_list(info):
            env += f" (`{meta.separator}`-separated)"
        default = _default_text(info, meta)
        rows.append(f"| `{flag}` | {env} | {default} | {(info.description or '').replace('|', '/')} |")
    return "\n".join(rows)
