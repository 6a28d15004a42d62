"""The architecture and the configuration hold their promises: the trainer side imports nothing of
the server, and every setting is defined once (flags, variables and the docs' tables come from one
model). What the docs say is checked in tests/test_docs.py, against the code, not against wording."""

from __future__ import annotations

import argparse
import subprocess
import sys

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
