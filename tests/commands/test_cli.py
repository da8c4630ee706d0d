"""The command group: instant --help (no heavy imports), --version, exit codes, error mapping."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from rltool import __version__
from rltool.cli import COMMANDS, main
from rltool.commands.common import handle_errors
from rltool.errors import (EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_RUNTIME, BadInputError,
                           EngineError, GateFailedError)

HEAVY = ("torch", "transformers", "pyarrow", "megatron")


@pytest.mark.parametrize("argv", [["--help"], ["--version"]] + [[name, "--help"] for name in COMMANDS])
def test_help_imports_no_heavy_module(argv):
    code = (
        "import sys, json, rltool.cli\n"
        f"try:\n    rltool.cli.main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
        f"print(json.dumps([code, sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    exit_code, heavy = json.loads(out.strip().splitlines()[-1])
    assert exit_code in (0, None) and heavy == [], f"{argv} imported {heavy}"


def test_help_lists_every_command():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name, (_, summary) in COMMANDS.items():
        assert name in result.output and summary[:20] in result.output
    assert "Exit codes" in result.output


def test_every_command_module_loads_and_documents_an_example():
    for name in COMMANDS:
        cmd = main.get_command(click.Context(main), name)
        assert isinstance(cmd, click.Command), name
        subcommands = cmd.commands.values() if isinstance(cmd, click.Group) else [cmd]
        for sub in subcommands:
            assert "Example:" in (sub.help or ""), f"{name} {sub.name} lacks an Example: block"


def test_version_and_usage_errors():
    runner = CliRunner()
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output
    assert runner.invoke(main, ["no-such-command"]).exit_code == EXIT_BAD_INPUT
    assert runner.invoke(main, ["data", "make", "--task", "reverse"]).exit_code == EXIT_BAD_INPUT


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "rltool", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and __version__ in out.stdout


@pytest.mark.parametrize("exc,code,message", [
    (BadInputError("bad --x; use 1"), EXIT_BAD_INPUT, "Error: bad --x; use 1"),
    (GateFailedError("gate: 3 tokens over tol"), EXIT_CHECK_FAILED, "Error: gate: 3 tokens"),
    (EngineError("engine died"), EXIT_RUNTIME, "Error: engine died"),
    (FileNotFoundError(2, "No such file", "x.toml"), EXIT_BAD_INPUT, "x.toml: no such file"),
    (PermissionError(13, "Permission denied", "/root/x"), EXIT_BAD_INPUT, "Permission denied"),
    (KeyError("surprise"), EXIT_RUNTIME, "unexpected internal failure"),
])
def test_errors_map_to_exit_codes(exc, code, message):
    @click.command()
    @handle_errors
    def cmd():
        raise exc

    result = CliRunner().invoke(cmd, [])
    assert result.exit_code == code
    assert message in result.output
    if code != EXIT_RUNTIME or isinstance(exc, EngineError):  # typed errors: one line, no traceback
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("exc,code", [(click.UsageError("bad"), 2), (click.exceptions.Exit(0), 0),
                                      (click.exceptions.Exit(1), 1), (click.Abort(), 1)])
def test_click_control_flow_passes_through(exc, code):
    """Bug guard: the catch-all for unexpected errors must not turn ctx.exit()/usage errors into
    exit 3."""
    @click.command()
    @handle_errors
    def cmd():
        raise exc

    result = CliRunner().invoke(cmd, [])
    assert result.exit_code == code and "internal failure" not in result.output
