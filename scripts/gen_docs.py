"""The generated parts of the docs site, from the code's single definitions.

    python scripts/gen_docs.py [--out docs/generated]

writes
- `http-api.md`: every route and schema of the service, from the app's OpenAPI schema
  (`create_app(...).openapi()`), so the API is described once, by the code;
- `configuration.md`: every command-line flag of `rollout-service` and `refenv`: the settings
  models' tables (`rollout_service.flags.markdown_table`: flag, variable, default, meaning) and,
  for the commands without a settings model, their argparse definitions; and every field of the
  Ray deployment's file (`ClusterConfig`).
docs/http-api.md and docs/configuration.md include them. Run by `make docs`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from refenv import cli as refenv_cli  # noqa: E402
from refenv.config import ENV_PREFIX as REFENV_PREFIX  # noqa: E402
from refenv.config import TEACHER_ENV_PREFIX, Settings, TaskSuite, TeacherSettings  # noqa: E402
from rollout_service.cluster.config import ClusterConfig  # noqa: E402
from rollout_service.flags import markdown_table  # noqa: E402
from rollout_service.server.config import ENV_PREFIX, ServiceConfig  # noqa: E402
from rollout_service.server.http.app import create_app  # noqa: E402
from rollout_service.tools import cli as service_cli  # noqa: E402

# The commands whose flags come from a settings model: (program, command) -> [(model, prefix)].
SETTINGS_MODELS: dict[tuple[str, str], list[tuple[Any, str]]] = {
    ("rollout-service", "serve"): [(ServiceConfig, ENV_PREFIX)],
    ("refenv", "serve"): [(Settings, REFENV_PREFIX)],
    ("refenv", "teacher"): [(TeacherSettings, TEACHER_ENV_PREFIX), (TaskSuite, REFENV_PREFIX)],
}
HTTP_METHODS = ("get", "post", "put", "patch", "delete")


# ---- HTTP API ----------------------------------------------------------------------------------


def openapi() -> dict[str, Any]:
    """The service's OpenAPI schema (the app is built, never started: no backend is asked anything)."""
    config = ServiceConfig(env=["http://127.0.0.1:9"], vllm=["http://127.0.0.1:9"], model="policy")
    return create_app(config).openapi()


def _anchor(name: str) -> str:
    return "schema-" + name.lower()


def _type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor(name)})"
    if "anyOf" in schema:
        return " or ".join(_type(s) for s in schema["anyOf"])
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return _type(schema["allOf"][0])
    if "enum" in schema:
        return " / ".join(f"`{v}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    kind = schema.get("type")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map of {_type(schema['additionalProperties'])}"
    return str(kind or "any")


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _bounds(schema: dict[str, Any]) -> str:
    marks = {"minimum": "≥", "exclusiveMinimum": ">", "maximum": "≤", "exclusiveMaximum": "<"}
    parts = [f"{sign} {_number(schema[key])}" for key, sign in marks.items() if key in schema]
    for option in schema.get("anyOf", []):
        parts += [f"{sign} {_number(option[key])}" for key, sign in marks.items() if key in option]
    return ", ".join(parts)


def _text(value: Any) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def _schema_table(name: str, schema: dict[str, Any]) -> list[str]:
    lines = [f'<a id="{_anchor(name)}"></a>', f"### {name}", ""]
    if schema.get("description"):
        lines += [_text(schema["description"]), ""]
    properties = schema.get("properties", {})
    if not properties:
        return [*lines, f"Type: {_type(schema)}.", ""]
    required = set(schema.get("required", []))
    lines += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    for field, spec in properties.items():
        default = "required" if field in required else f"`{json.dumps(spec['default'])}`" if "default" in spec else ""
        default = default.replace("|", "\\|")
        lines.append(
            f"| `{field}` | {_type(spec)} | {default} | {_bounds(spec)} | {_text(spec.get('description', ''))} |"
        )
    return [*lines, ""]


def http_api_markdown(schema: dict[str, Any]) -> str:
    lines = ["## Routes", ""]
    lines += ["| route | what |", "|---|---|"]
    routes = [(method.upper(), path, op) for path, ops in schema["paths"].items() for method, op in ops.items()]
    for method, path, op in routes:
        anchor = f"route-{method.lower()}-{path.strip('/').replace('/', '-')}"
        lines.append(f"| [`{method} {path}`](#{anchor}) | {_text(op.get('summary', ''))} |")
    lines.append("")
    for method, path, op in routes:
        anchor = f"route-{method.lower()}-{path.strip('/').replace('/', '-')}"
        lines += [f'<a id="{anchor}"></a>', f"### `{method} {path}`", ""]
        if op.get("summary"):
            lines += [f"**{_text(op['summary'])}.**", ""]
        if op.get("description"):
            lines += [op["description"].strip(), ""]
        body = op.get("requestBody", {}).get("content", {})
        for media, spec in body.items():
            lines += [f"Request body (`{media}`): {_type(spec.get('schema', {}))}.", ""]
        errors = []
        for status, response in op.get("responses", {}).items():
            content = response.get("content", {})
            if status.startswith(("4", "5")):
                errors.append(status)
                continue
            shapes = ", ".join(f"{_type(s.get('schema', {}))} (`{m}`)" for m, s in content.items() if s.get("schema"))
            answer = f"Answer {status}: {_text(response.get('description', ''))}"
            lines += [answer + (f"; {shapes}" if shapes else ""), ""]
        if errors:
            lines += [f"Errors, each an [ErrorBody](#{_anchor('ErrorBody')}): {', '.join(errors)}.", ""]
    lines += ["## Schemas", ""]
    for name, spec in sorted(schema.get("components", {}).get("schemas", {}).items()):
        lines += _schema_table(name, spec)
    return "\n".join(lines)


# ---- configuration ------------------------------------------------------------------------------


def commands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command under `parser`, as ("program command ...", its parser)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((f"{prefix} {name}", sub))
                found += commands(sub, f"{prefix} {name}")
    return found


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]


def _argparse_table(parser: argparse.ArgumentParser) -> list[str]:
    if not _options(parser) and not _positionals(parser):
        return []
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for action in _options(parser):
        flag = ", ".join(action.option_strings) + (f" {action.metavar}" if action.metavar else "")
        default = "" if action.default in (None, argparse.SUPPRESS) else f"`{action.default}`"
        help_text = (action.help or "").replace("%%", "%") if action.help != argparse.SUPPRESS else ""
        lines.append(f"| `{flag}` | {_text(default)} | {_text(help_text)} |")
    for action in _positionals(parser):
        lines.append(f"| `{action.metavar or action.dest}` (positional) | | {_text(action.help or '')} |")
    return lines


def configuration_markdown() -> str:
    lines = []
    for program, parser in (("rollout-service", service_cli.build_parser()), ("refenv", refenv_cli.build_parser())):
        lines += [f"## `{program}`", ""]
        for command, sub in commands(parser, program):
            if not _options(sub) and not any(not a.option_strings for a in sub._actions if a.dest != "help"):
                continue
            key = (program, command.split(" ", 1)[1])
            lines += [f"### `{command}`", ""]
            if sub.description:
                lines += [_text(sub.description), ""]
            models = SETTINGS_MODELS.get(key)
            if models:
                for model, env_prefix in models:
                    lines += [markdown_table(model, env_prefix), ""]
                named = {f for model, _ in models for f in _model_flags(model)}
                rest = [a for a in _options(sub) if not set(a.option_strings) & named]
                if rest:
                    extra = argparse.ArgumentParser(add_help=False)
                    extra._actions = rest  # only for the table
                    lines += ["Also:", "", *_argparse_table(extra), ""]
            else:
                lines += [*_argparse_table(sub), ""]
    return "\n".join(lines)


def cluster_file_markdown() -> str:
    """The fields of `rollout-service ray --config FILE`, from its pydantic model."""
    schema = ClusterConfig.model_json_schema()
    lines = [
        "## The Ray deployment's file",
        "",
        "`rollout-service ray ... --config FILE`: YAML, every field optional; a wrong one is refused with its name"
        " before anything starts.",
        "",
        *_schema_table("ClusterConfig", schema),
    ]
    for name, spec in sorted(schema.get("$defs", {}).items()):
        lines += _schema_table(name, spec)
    return "\n".join(lines)


def _model_flags(model: Any) -> set[str]:
    return {"--" + name.replace("_", "-") for name in model.model_fields}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "generated")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "http-api.md").write_text(http_api_markdown(openapi()) + "\n")
    (args.out / "configuration.md").write_text(configuration_markdown() + "\n\n" + cluster_file_markdown() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
