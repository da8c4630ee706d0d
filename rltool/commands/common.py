"""Helpers every command uses: error -> exit-code mapping and JSON output. (Options: options.py.)"""

from __future__ import annotations

import functools
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import click

from rltool.errors import EXIT_BAD_INPUT, EXIT_RUNTIME, RltoolError

F = TypeVar("F", bound=Callable[..., Any])


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
        except Exception:  # noqa: BLE001 - printed with its traceback, then exit 3
            # A bug or an unexpected failure: keep the traceback, but exit 3 (runtime failure), not
            # Python's 1, which scripts would read as "a check failed".
            click.echo(traceback.format_exc().rstrip(), err=True)
            click.echo("Error: unexpected internal failure (traceback above)", err=True)
            sys.exit(EXIT_RUNTIME)

    return wrapper  # type: ignore[return-value]


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))
