"""Stage configs: TOML file + explicit flags, validated by the stage's strict pydantic model.

A loop config has one table per stage (`[rollout]`, `[train]`, ...); a stage command given
`--config FILE` reads its own table (or the top level when the file has no such table). Keys are
the stage's flag names with underscores. Flags given on the command line win over the file.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler, ValidationError
from pydantic_core import core_schema

from rltool import atomic
from rltool.errors import ConfigError

M = TypeVar("M", bound=BaseModel)
# Tables a loop config may hold, one per stage (docs/loop.md).
STAGE_SECTIONS = ("model", "rollout", "train", "sync", "eval", "loop", "serve", "delta", "align",
                  "convert", "profile", "plan", "data", "init_model")


class StageConfig(BaseModel):
    """Base of every stage's config: unknown keys are errors, floats are finite (no inf/nan),
    values are validated on assignment.

    Each field is also a command-line option of the stage's command (`rltool.commands.options`
    generates them: `--name-with-dashes`, its type, choices, description and default); `cli(...)`
    in a field's `json_schema_extra` adjusts how (environment variable, positional, not a flag).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              protected_namespaces=())


def cli(*, envvar: str | None = None, argument: bool = False, option: bool = True,
        metavar: str | None = None) -> dict[str, Any]:
    """A field's command-line form, for `Field(json_schema_extra=cli(...))`.

    envvar: the option falls back to this environment variable (keys and tokens);
    argument: a required positional argument instead of an option;
    option=False: settable from the config file only (the loop or the command fills it).
    """
    return {"cli": {"envvar": envvar, "argument": argument, "option": option,
                    "metavar": metavar}}


@dataclass(frozen=True)
class Aliases:
    """Other accepted spellings of a Literal field's values, as `Annotated[Literal[...],
    Aliases(...)]`: the alias is replaced by its canonical value before validation (and the
    generated option accepts it too)."""

    pairs: tuple[tuple[str, str], ...]

    @property
    def mapping(self) -> dict[str, str]:
        return dict(self.pairs)

    def __get_pydantic_core_schema__(self, source: Any,
                                     handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        mapping = self.mapping
        return core_schema.no_info_before_validator_function(
            lambda v: mapping.get(v, v) if isinstance(v, str) else v, handler(source))


# One dtype spelling for every stage (fp32, bf16, fp16); torch's long names are aliases.
DTYPE_ALIASES = Aliases((("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16")))
ComputeDtype = Annotated[Literal["fp32", "bf16"], DTYPE_ALIASES]
WeightDtype = Annotated[Literal["fp32", "bf16", "fp16"], DTYPE_ALIASES]
TORCH_DTYPE_NAMES = {short: long for long, short in DTYPE_ALIASES.pairs}


def torch_dtype_name(dtype: str) -> str:
    """`bf16` -> `bfloat16` (the attribute of torch and the `torch_dtype` of a HF config.json)."""
    return TORCH_DTYPE_NAMES[dtype]


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path} does not exist; pass an existing --config FILE") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e}); save it as UTF-8") from e


def url_error(url: str) -> str | None:
    """Why `url` is not an engine URL (http or https, with a host; or an in-process engine's),
    naming the fix; None if it is."""
    from urllib.parse import urlsplit

    if url.startswith("inprocess://"):  # rltool.engine.inprocess.URL_SCHEME (the loop's)
        return None
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parses the port: ValueError when it is not a number
    except ValueError as e:
        return f"{url!r} is not a valid URL ({e}); pass http://HOST:PORT"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http(s) URL with a host; pass http://HOST:PORT"
    return None


def checked_urls(value: list[str] | str | None) -> list[str] | str | None:
    """`value` (an engine URL, a list of them, or None) as it is; ValueError naming the first
    that `url_error` refuses (for field validators)."""
    for url in [value] if isinstance(value, str) else value or []:
        if problem := url_error(url):
            raise ValueError(problem)
    return value


def format_validation_error(err: ValidationError, *, section: str | None = None) -> str:
    """One line naming the flag(s) at fault: `--max-response-len: Input should be > 0`."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        flag = "--" + loc.replace("_", "-").lower() if loc else "(config)"
        where = f" (in [{section}])" if section else ""
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown key {loc!r}; check its spelling against `--help`"
        parts.append(f"{flag}{where}: {msg}")
    return "; ".join(parts)


def resolve(model: type[M], *, config_file: str | os.PathLike | None, section: str | None,
            flags: dict[str, Any]) -> M:
    """Build `model` from the config file's table and the explicitly given flags (flags win)."""
    values: dict[str, Any] = {}
    if config_file is not None:
        data = read_toml(config_file)
        if section is not None and isinstance(data.get(section), dict):
            data = data[section]
        elif section is not None:
            # A loop config without this stage's table: the other stages' tables are theirs.
            data = {k: v for k, v in data.items()
                    if not (k in STAGE_SECTIONS and isinstance(v, dict))}
        values.update(data)
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        return model(**values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, section=section)) from e


def is_secret_key(name: str) -> bool:
    """A config key that holds a secret (`api_key`, `admin_api_key`, `opd_teacher_api_key`)."""
    return name.endswith("api_key")


def without_secrets(value: Any) -> Any:
    """A config with its API keys left out (`*api_key` keys, `--*api-key=V` and the value after
    `--*api-key` in argument lists)."""
    if isinstance(value, dict):
        return {k: without_secrets(v) for k, v in value.items() if not is_secret_key(k)}
    if isinstance(value, list):
        return [v for i, v in enumerate(value) if "api-key=" not in str(v)
                and not (i > 0 and str(value[i - 1]).endswith("api-key"))]
    return value


def write_resolved(cfg: BaseModel, path: str | os.PathLike) -> None:
    """Write a stage's resolved config as TOML next to its outputs, without its keys."""
    import tomli_w

    data = without_secrets(cfg.model_dump(mode="json", exclude_none=True))
    atomic.write_text(path, tomli_w.dumps(data))
