"""The `zeropipe` command: every command module is registered, each --help works, a bad config is one message."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from pathlib import Path

import pytest
import yaml

import zeropipe.cli
from tests.integration.conftest import tiny_run_config
from zeropipe.cli.main import COMMANDS, build_parser, main

EXPECTED = ["train", "convert", "check", "plan", "export", "eval", "generate", "doctor", "calibrate", "ui", "runs"]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_command_module_is_registered_once():
    """A module of zeropipe.cli with a register() that main does not call would be a command nobody can run."""
    with_register = {
        info.name for info in pkgutil.iter_modules(zeropipe.cli.__path__) if hasattr(importlib.import_module(f"zeropipe.cli.{info.name}"), "register")
    }
    assert {module.__name__.rsplit(".", 1)[1] for module in COMMANDS} == with_register
    assert len(COMMANDS) == len(set(COMMANDS))
    assert list(subcommands(build_parser())) == EXPECTED


@pytest.mark.parametrize("command", EXPECTED)
def test_each_command_has_a_help_page(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: zeropipe {command}") and "options:" in out
    assert subcommands(build_parser())[command].format_help() == out  # the page argparse built, not a fallback


def test_each_runs_action_has_a_help_page(capsys):
    actions = subcommands(subcommands(build_parser())["runs"])
    assert set(actions) == {"ls", "show", "logs", "stop"}
    for action in actions:
        with pytest.raises(SystemExit) as exited:
            main(["runs", action, "--help"])
        assert exited.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: zeropipe runs {action}")


def test_no_command_prints_the_help_and_fails_and_version_works(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: zeropipe") and all(command in out for command in EXPECTED)
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("zeropipe ")
    with pytest.raises(SystemExit) as exited:
        main(["trian", "run.yaml"])
    assert exited.value.code == 2 and "invalid choice: 'trian'" in capsys.readouterr().err


def bad_config(tmp_path: Path) -> Path:
    """A config with three mistakes: a misspelt section key, a value of the wrong type, and a negative step count."""
    config = tiny_run_config(tmp_path)
    config["train"].update({"max_stepz": 10, "lr": "fast", "max_steps": -3})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.parametrize("command", ["train", "check", "plan"])
def test_a_bad_config_is_one_message_naming_every_key_and_nothing_starts(tmp_path, capsys, command):
    # In-process: the exit status through `python -m zeropipe` is checked by
    # tests/integration/test_resume_and_failures.py::test_config_error_names_every_key_and_starts_nothing.
    assert main([command, str(bad_config(tmp_path))]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith(f"zeropipe {command}: error: 3 problem(s) in {tmp_path / 'bad.yaml'}:"), err
    assert err.count("error:") == 1 and "Traceback" not in err + captured.out
    for key in ("train.max_stepz", "train.lr", "train.max_steps"):
        assert f"  - {key}: " in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["train", "check", "plan"])
def test_a_missing_or_unreadable_config_is_one_message(tmp_path, capsys, command):
    assert main([command, str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zeropipe {command}: error:") and "missing.yaml" in err and "Traceback" not in err

    broken = tmp_path / "broken.yaml"
    broken.write_text("train: {max_steps: 3\nmodel: [\n")
    assert main([command, str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zeropipe {command}: error:") and "broken.yaml" in err and "Traceback" not in err
