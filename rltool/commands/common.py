"""Helpers every command uses: `--config`, `--json`, flag collection and error → exit-code mapping."""

from __future__ import annotations

import functools
import json
import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import click

from rltool.errors import EXIT_BAD_INPUT, EXIT_RUNTIME, RltoolError

F = TypeVar("F", bound=Callable[..., Any])

config_option = click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), default=None,
    help="TOML file with this stage's keys (flag names with underscores); flags override it.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bars or human output.")


def explicit_flags(ctx: click.Context, names: list[str] | None = None) -> dict[str, Any]:
    """The options the user actually gave (command line or env), so file values are not masked by
    click defaults. Options whose click default is None count only when given."""
    out = {}
    for name, value in ctx.params.items():
        if names is not None and name not in names:
            continue
        source = ctx.get_parameter_source(name)
        if source in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT):
            out[name] = value
    return out


def handle_errors(fn: F) -> F:
    """Turn typed errors into a one-line `Error: ...` on stderr and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RltoolError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(e.exit_code)
        except FileNotFoundError as e:
            click.echo(f"Error: {e.filename or e}: no such file or directory", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except (FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
            # A path the user named is unusable: bad input, like a missing file.
            click.echo(f"Error: {e.filename or ''}: {e.strerror or e}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own control flow: usage errors (exit 2), ctx.exit(), Ctrl-C
        except Exception:
            # A bug or an unexpected failure: keep the traceback, but exit 3 (runtime failure), not
            # Python's 1, which scripts would read as "a check failed".
            click.echo(traceback.format_exc().rstrip(), err=True)
            click.echo("Error: unexpected internal failure (traceback above)", err=True)
            sys.exit(EXIT_RUNTIME)

    return wrapper  # type: ignore[return-value]


def split_dirs(ctx: click.Context, param: click.Parameter, values: Any) -> list[str] | None:
    """Callback of a repeatable `--opt DIR[,DIR...]` option: one flat list, or None when absent."""
    if not values:
        return None
    return [d for value in values for d in value.split(",") if d]


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def setup_logging(*, quiet: bool = False) -> None:
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
