"""The stage tables of a loop config, typed, and the checks that span tables.

[rollout], [train] and [eval] become their stages' own configs (RolloutConfig, TrainConfig,
EvalConfig) once, when the config is read: each with the values the loop gives every step
(`seed` from [loop], the engines' key, `quiet`, the trainer's device and dtype, ...) and, for the
keys it decides per step (OWNED, and `engines`), placeholders that `LoopSettings.rollout_config`
and its siblings replace with `model_copy(update=...)`. Building them with the per-step shape is
what validates them: every cross-field check of the stage runs before anything is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from rltool.config import format_validation_error
from rltool.delta.config import SyncConfig
from rltool.errors import ConfigError
from rltool.loop.affinity import check_cores
from rltool.rollout.eval import EvalConfig
from rltool.rollout.stage import RolloutConfig
from rltool.rundir import RunDir
from rltool.train.config import TrainConfig

if TYPE_CHECKING:
    from rltool.loop.config import LoopConfig, LoopSettings

TABLES = ("model", "rollout", "train", "sync", "eval", "loop")
# Keys each stage table may not set: the loop decides them per step.
OWNED = {
    "rollout": ("engines", "router", "out", "step", "metrics", "policy_version", "tokenizer",
                "quiet"),
    "eval": ("engines", "router", "out", "step", "metrics", "policy_version", "tokenizer", "quiet"),
    "train": ("rollouts", "prompts", "load", "save", "publish", "metrics"),
}
# [eval] keys that default to [rollout]'s value when the [eval] table leaves them out.
EVAL_INHERITS = ("reward", "max_response_len", "temperature", "top_p", "top_k", "seed",
                 "generate_fn", "api_key", "request_timeout_s", "reward_timeout_s",
                 "reward_workers", "concurrency", "samples_per_request", "input_key",
                 "label_key", "metadata_key", "apply_chat_template")
# The per-step keys' stand-ins until a step fills them.
PLACEHOLDER_URL = "http://127.0.0.1:1"
PLACEHOLDER_RUN = RunDir("/nonexistent-run")


def read_tables(data: dict[str, Any], *, overrides: dict[str, dict[str, Any]] | None
                ) -> dict[str, dict[str, Any]]:
    """The six tables of a loop config with `--set` overrides applied; unknown tables, keys the
    loop owns and weight-sync keys under [train] refused."""
    tables: dict[str, dict[str, Any]] = {}
    for name in TABLES:
        value = data.get(name, {})
        if not isinstance(value, dict):
            raise ConfigError(f"[{name}] must be a table, got {type(value).__name__}")
        tables[name] = dict(value)
    unknown = sorted(set(data) - set(tables))
    if unknown:
        raise ConfigError(f"unknown table(s) {unknown}; a loop config has [model], "
                          "[rollout], [train], [sync], [eval] and [loop]")
    for name, values in (overrides or {}).items():
        if name not in tables:
            raise ConfigError(f"--set {name}.*: unknown table; use one of {sorted(tables)}")
        tables[name].update(values)
    for name, owned in OWNED.items():
        clash = sorted(set(tables[name]) & set(owned))
        if clash:
            raise ConfigError(f"[{name}] sets {clash}, which the loop decides per step; "
                              "remove them from the table")
    misplaced = sorted(set(tables["train"]) & set(SyncConfig.model_fields))
    if misplaced:
        # TrainConfig accepts them (for `rltool train --publish`), but the loop publishes
        # with [sync]: under [train] they would be silently ignored.
        raise ConfigError(f"[train] sets {misplaced}: weight-sync keys belong in the [sync] "
                          "table of a loop config; move them there")
    return tables


def rollout_table(table: dict[str, Any], *, loop: LoopConfig) -> RolloutConfig:
    values = dict(table)
    values.setdefault("seed", loop.seed if loop.deterministic else None)
    if loop.use_rollout_routing_replay:
        values["use_rollout_routing_replay"] = True
    if values.get("opd_teacher_api_key") is None and loop.opd_teacher_api_key:
        values["opd_teacher_api_key"] = loop.opd_teacher_api_key
    values.update(_target(loop, values), out=str(PLACEHOLDER_RUN.rollout_step(0)), step=0,
                  quiet=True, metrics=str(PLACEHOLDER_RUN.metrics_file("rollout")))
    return validate(RolloutConfig, values, "rollout")


def eval_table(table: dict[str, Any], *, rollout: RolloutConfig, rollout_keys: tuple[str, ...],
               loop: LoopConfig) -> EvalConfig:
    """[eval] over the [rollout] keys it inherits (those the [rollout] table set)."""
    values = {k: getattr(rollout, k) for k in EVAL_INHERITS if k in rollout_keys}
    values.update(table)
    values.update(_target(loop, values), out=str(PLACEHOLDER_RUN.eval_step(0)), step=0,
                  quiet=True, metrics=str(PLACEHOLDER_RUN.metrics_file("eval")),
                  policy_version=0)
    return validate(EvalConfig, values, "eval")


def train_table(table: dict[str, Any], *, loop: LoopConfig, device: str,
                load: str) -> TrainConfig:
    values = dict(table)
    values.setdefault("seed", loop.seed)
    values.setdefault("device", device)
    if values["device"] == "cuda" or (values["device"] == "auto" and device == "cuda"):
        values.setdefault("dtype", "bf16")
    if loop.deterministic:
        values["deterministic"] = True
    if loop.use_rollout_routing_replay:
        values["use_rollout_routing_replay"] = True
    values.update(rollouts=[str(PLACEHOLDER_RUN.rollout_step(0))], load=load,
                  save=str(PLACEHOLDER_RUN.ckpt), metrics=str(PLACEHOLDER_RUN.metrics_file("train")))
    return validate(TrainConfig, values, "train")


def _target(loop: LoopConfig, values: dict[str, Any]) -> dict[str, Any]:
    """Where a rollout or eval sends its requests (the gateway of router_url, else the engines
    themselves, a placeholder until a step names them) and the loop's key unless `values` set
    one: api_key, else, for engines (never a gateway), admin_api_key, which opens every route
    of theirs."""
    target: dict[str, Any] = ({"router": loop.router_url} if loop.router_url
                              else {"engines": [PLACEHOLDER_URL]})
    key = loop.api_key
    if key is None and not loop.router_url:
        key = loop.admin_api_key
    if key is not None and values.get("api_key") is None:
        target["api_key"] = key
    return target


def check_settings(settings: LoopSettings) -> None:
    """The checks that span tables: placement, mode, sync, launcher and engine combinations."""
    loop, sync = settings.loop, settings.sync
    if loop.mode == "async" and loop.placement == "colocated":
        raise ConfigError("--mode async generates while the trainer trains, so engines and "
                          "trainer need resources of their own: use --placement "
                          "disaggregated (and --engine-cores/--trainer-cores on one host)")
    if loop.mode == "async" and (settings.rollout.filter != "none" or settings.rollout.partial):
        raise ConfigError("--mode async trains every finished group in completion order: "
                          "remove [rollout] filter and partial")
    for option, cores in (("engine-cores", loop.engine_cores),
                          ("trainer-cores", loop.trainer_cores)):
        if cores is not None:
            check_cores(cores, option=option)
    if sync.sync in ("tensor", "distributed") and loop.placement != "colocated" \
            and loop.mode != "async":
        raise ConfigError(f"--sync {sync.sync} hands weights to engines on the trainer's host: "
                          "use --placement colocated, or --sync full, delta or auto")
    if loop.engine == "inprocess" and (loop.external or loop.launcher == "ray"):
        raise ConfigError("[loop] engine = \"inprocess\" runs the engine in the loop's own "
                          "process; it excludes engine_urls, router_url and --launcher ray")
    if loop.engine == "inprocess":
        settings.serve_config(settings.model.path)
    if sync.sync in ("tensor", "distributed") and loop.launcher == "ray":
        raise ConfigError(f"--sync {sync.sync} is not available with --launcher ray (a "
                          "restarted engine actor is brought up to date from disk): use --sync "
                          "full, delta or auto")
    if sync.sync == "tensor" and loop.external:
        raise ConfigError("--sync tensor hands weights over shared memory to engines the loop "
                          "starts on its host; external engines take --sync full, delta, auto "
                          "or distributed")
    if sync.precision in ("fp8", "int4") and loop.external and sync.sync == "auto":
        raise ConfigError(f"--precision {sync.precision} reaches external engines on disk only "
                          "(auto may pick a broadcast, which carries no scales): use --sync full "
                          "or delta")
    if loop.eval_interval is not None and settings.eval is None:
        raise ConfigError("[loop] eval_interval needs an [eval] table with prompts = FILE")
    from rltool.loop import lora_sync

    lora_sync.check_settings(settings)


def validate(model: type[Any], values: dict[str, Any], section: str) -> Any:
    try:
        return model(**values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, section=section)) from e
