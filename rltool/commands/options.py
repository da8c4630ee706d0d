"""Command-line options: generated from the stage config models, plus the command's own options.

One declaration per setting. A stage setting is a field of the stage's pydantic model
(`rltool.config.StageConfig`); `stage_options(Model, table=...)` turns every field into an option
with the field's name (`--max-response-len`), type, choices, description and default, so neither
a flag list nor a default is restated here. The mechanisms, one each:

- booleans are `--name/--no-name`; a `Literal` is a choice (with its `Aliases`, e.g. dtypes);
- a list field is repeatable and each value may be comma-separated: `--rollouts A,B --rollouts C`;
- a fixed tuple takes that many values: `--block 128 128`;
- an environment-variable fallback is declared on the field, `cli(envvar="RLTOOL_API_KEY")`;
- `cli(argument=True)` makes a field positional, `cli(option=False)` leaves it to the file;
- a key an earlier version had (the model's `retired_keys`: name -> one-line refusal) stays a
  hidden option that fails with that refusal (exit 2), so an old command line names the fix;
- every option carries the config table it feeds (`table`): a command may take options of
  several tables (the loop's `--sync` feeds `[sync]`, `--num-steps` feeds `[loop]`), and
  `given(ctx, table)` collects the ones the user gave for one table.

Options that belong to the command, not to a stage (`--config`, `--json`, `--resume`, ...), are
declared once in `COMMAND_OPTIONS`; `command_options(...)` adds the ones a command takes plus
`-q/--quiet` and `-v/--verbose` (every command), sets up logging once and maps errors to exit
codes. Click defaults of stage options are None, so a value from `--config FILE` is never masked
by a default the user did not give.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rltool.config import Aliases

F = Callable[..., Any]


class StageOption(click.Option):
    """An option generated from a stage config field; `table` is the config table it feeds."""

    def __init__(self, *args: Any, table: str, field: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.table, self.field = table, field


class StageArgument(click.Argument):
    def __init__(self, *args: Any, table: str, field: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.table, self.field = table, field


class AliasChoice(click.Choice):
    """A choice that also accepts the aliases of its values (`bfloat16` for `bf16`)."""

    def __init__(self, choices: list[str], aliases: dict[str, str]):
        super().__init__(choices)
        self.aliases = aliases

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        return super().convert(self.aliases.get(value, value), param, ctx)


def cli_meta(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    meta = {"envvar": None, "argument": False, "option": True, "metavar": None}
    meta.update(extra.get("cli") or {})  # type: ignore[arg-type]
    return meta


def _unwrap(annotation: Any, metadata: list[Any]) -> tuple[Any, list[Any]]:
    """`X | None` -> X and `Annotated[X, m]` -> X (m joins the field's metadata)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0], metadata)
    if typing.get_origin(annotation) is typing.Annotated:
        return _unwrap(annotation.__origin__, [*metadata, *annotation.__metadata__])
    return annotation, metadata


def _scalar_type(annotation: Any, metadata: list[Any]) -> Any:
    if typing.get_origin(annotation) is typing.Literal:
        choices = [str(c) for c in typing.get_args(annotation)]
        aliases = next((m.mapping for m in metadata if isinstance(m, Aliases)), None)
        return AliasChoice(choices, aliases) if aliases else click.Choice(choices)
    if annotation in (int, float, str):
        return annotation
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return click.Path()
    raise TypeError(f"no command-line form for {annotation!r}; give the field cli(option=False)")


def _help(field: FieldInfo) -> str:
    """The field's description and its default, the one place either is written."""
    text = field.description or ""
    default = field.default
    if default is PydanticUndefined or default is None or default == [] or default == ():
        return text
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif isinstance(default, tuple):
        shown = " ".join(str(v) for v in default)
    else:
        shown = str(default)
    return f"{text}  [default: {shown}]"


def _split_commas(ctx: click.Context, param: click.Parameter, values: Any) -> list[str] | None:
    """A repeatable option whose values may each be comma-separated: one flat list, or None."""
    if not values:
        return None
    return [v for value in values for v in str(value).split(",") if v]


def field_param(name: str, field: FieldInfo, *, table: str) -> click.Parameter | None:
    """The click parameter of one config field (None when the field is not on the command line)."""
    meta = cli_meta(field)
    if not meta["option"]:
        return None
    flag = "--" + name.replace("_", "-")
    annotation, metadata = _unwrap(field.annotation, list(field.metadata))
    origin = typing.get_origin(annotation)
    common: dict[str, Any] = {"table": table, "field": name}
    if meta["argument"]:
        return StageArgument([name], required=True, type=_scalar_type(annotation, metadata),
                             metavar=meta["metavar"], **common)
    kwargs: dict[str, Any] = {
        "default": None, "help": _help(field),
        "metavar": meta["metavar"], "envvar": meta["envvar"], "show_envvar": bool(meta["envvar"]),
    }
    decls = [flag, name]
    if annotation is bool:
        decls = [f"{flag}/--no-{flag[2:]}", name]
    elif origin in (list, tuple) and (origin is list or typing.get_args(annotation)[-1] is ...):
        item = typing.get_args(annotation)[0]
        kwargs.update(multiple=True, callback=_split_commas, type=str,
                      metavar=meta["metavar"] or f"{_scalar_name(item)}[,{_scalar_name(item)}...]")
    elif origin is tuple:
        items = typing.get_args(annotation)
        kwargs.update(nargs=len(items), type=_scalar_type(items[0], metadata))
    else:
        kwargs["type"] = _scalar_type(annotation, metadata)
    return StageOption(decls, **kwargs, **common)


def _scalar_name(item: Any) -> str:
    return "PATH" if isinstance(item, type) and issubclass(item, Path) else "TEXT"


def stage_options(model: type[BaseModel], *, table: str) -> Callable[[F], F]:
    """Add an option (or argument) for every field of `model`, feeding config table `table`.
    `--help` lists the model's own fields first, then those of its bases."""
    params = [p for name in _own_fields_first(model)
              for p in [field_param(name, model.model_fields[name], table=table)] if p is not None]
    params += [_retired_param(name, message)
               for name, message in getattr(model, "retired_keys", {}).items()]

    def decorate(fn: F) -> F:
        # What @click.option does: click.command collects __click_params__ (in reverse).
        memo = fn.__dict__.setdefault("__click_params__", [])
        existing = {p.name for p in memo}
        for param in reversed(params):
            if param.name in existing:
                raise TypeError(f"{model.__name__}.{param.name}: a second option of that name")
            memo.append(param)
        return fn

    return decorate


def _retired_param(name: str, message: str) -> click.Option:
    """A hidden option for retired key `name`: given at all (as a flag, its --no- form or with a
    value), it is a usage error with `message`."""
    def refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            raise click.UsageError(message, ctx)

    flag = "--" + name.replace("_", "-")
    # flag_value: the value is optional, so both `--old` and `--old VALUE` reach the refusal
    return click.Option([flag, f"--no-{flag[2:]}", f"retired_{name}"], is_flag=False,
                        flag_value="", default=None, hidden=True, expose_value=False,
                        callback=refuse)


def _own_fields_first(model: type[BaseModel]) -> list[str]:
    names: list[str] = []
    for cls in model.__mro__:
        for name in vars(cls).get("__annotations__", {}):
            if name in model.model_fields and name not in names:
                names.append(name)
    return names + [n for n in model.model_fields if n not in names]


def given(ctx: click.Context, table: str) -> dict[str, Any]:
    """The stage options of `table` the user gave (command line or environment), by field name."""
    out = {}
    for param in ctx.command.params:
        if not isinstance(param, (StageOption, StageArgument)) or param.table != table:
            continue
        source = ctx.get_parameter_source(param.name)  # type: ignore[arg-type]
        if source in (click.core.ParameterSource.COMMANDLINE,
                      click.core.ParameterSource.ENVIRONMENT):
            value = ctx.params[param.name]  # type: ignore[index]
            if value is not None:
                out[param.field] = list(value) if isinstance(param, StageOption) and \
                    param.nargs > 1 else value
    return out


def build_config(model: type[Any], *, table: str, extra: dict[str, Any] | None = None) -> Any:
    """The stage config of the running command: `--config FILE`'s `[table]`, then the options the
    user gave for `table`, then `extra` (values the command decides). A `quiet` field follows -q."""
    from rltool import config

    ctx = click.get_current_context()
    flags = given(ctx, table)
    if "quiet" in model.model_fields and is_quiet(ctx):
        flags["quiet"] = True
    flags.update(extra or {})
    return config.resolve(model, config_file=ctx.params.get("config_file"), section=table,
                          flags=flags)


# ----- options of the command itself ---------------------------------------------------------

def _remember(key: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        ctx.meta[key] = value
        return value

    return callback


COMMAND_OPTIONS: dict[str, Callable[[F], F]] = {
    "config": click.option(
        "--config", "config_file", type=click.Path(dir_okay=False), default=None,
        help="TOML config: the stage's table (keys are the option names with underscores; "
             "`rltool loop` reads every table); options given on the command line win."),
    "json": click.option("--json", "as_json", is_flag=True,
                         help="Print the result as JSON on stdout."),
    "run_dir": click.option("--run-dir", type=click.Path(file_okay=False), default=None,
                            help="New run directory to create [default: run]."),
    "resume": click.option("--resume", "resume_dir", type=click.Path(file_okay=False),
                           default=None, help="Continue the run in this directory from its "
                           "state.json, with its own config.toml."),
    "set": click.option("--set", "sets", multiple=True, metavar="TABLE.KEY=VALUE",
                        help="Override any key of the config, e.g. --set train.lr=3e-3 "
                             "(repeatable)."),
    "nproc_per_node": click.option("--nproc-per-node", type=click.IntRange(min=1), default=1,
                                   show_default=True,
                                   help="Processes to launch under torchrun (DDP/FSDP2)."),
}
VERBOSITY_OPTIONS = (
    click.option("-q", "--quiet", is_flag=True, expose_value=False, is_eager=True,
                 callback=_remember("rltool.quiet"),
                 help="Warnings and errors only; no progress bars."),
    click.option("-v", "--verbose", is_flag=True, expose_value=False, is_eager=True,
                 callback=_remember("rltool.verbose"),
                 help="Debug messages, and the per-request lines of HTTP clients."),
)


def is_quiet(ctx: click.Context | None = None) -> bool:
    ctx = ctx or click.get_current_context()
    return bool(ctx.meta.get("rltool.quiet"))


def verbosity(ctx: click.Context | None = None) -> int:
    """-1 with -q, 1 with -v, else 0 (-q wins when both are given)."""
    ctx = ctx or click.get_current_context()
    return -1 if ctx.meta.get("rltool.quiet") else int(bool(ctx.meta.get("rltool.verbose")))


def command_options(*names: str) -> Callable[[F], F]:
    """The command's own options (`COMMAND_OPTIONS` keys), -q/-v, one logging setup, and the
    mapping of errors to exit codes. Apply it under `@click.command` and the stage options."""
    from rltool.commands.common import handle_errors

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def with_logging(*args: Any, **kwargs: Any) -> Any:
            from rltool.logs import setup_logging

            setup_logging(verbosity=verbosity())
            return fn(*args, **kwargs)

        wrapped: F = handle_errors(with_logging)
        for option in reversed(VERBOSITY_OPTIONS):
            wrapped = option(wrapped)
        for name in reversed(names):
            wrapped = COMMAND_OPTIONS[name](wrapped)
        return wrapped

    return decorate
