"""The loop's config: one TOML file with a table per stage, each validated by that stage's model.

```
[model]   path = "models/tiny"            # initial weights, published as weight_v000000
[rollout] RolloutConfig keys               # minus the keys the loop owns (engines, out, step, ...)
[train]   TrainConfig keys                 # minus load, rollouts, save, publish, metrics, prompts
[sync]    SyncConfig keys                  # full | delta | auto | tensor | distributed
[eval]    EvalConfig keys (optional)       # prompts is required; reward, max_response_len,
                                           # temperature... default to [rollout]'s
[loop]    LoopConfig keys                  # steps, placement, engines, eval interval, gate
```
`LoopSettings.from_tables` validates every table up front (bad input changes nothing on disk);
per step the loop fills the owned keys with `rollout_config(step, ...)` etc.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from rltool.config import StageConfig, cli, format_validation_error, read_toml
from rltool.delta.config import SyncConfig
from rltool.engine.config import ServeConfig
from rltool.errors import ConfigError
from rltool.loop.affinity import check_cores
from rltool.rollout.eval import EvalConfig
from rltool.rollout.stage import RolloutConfig
from rltool.rundir import RunDir
from rltool.tracking import TrackingConfig
from rltool.train.config import TrainConfig

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
                 "reward_workers", "concurrency", "input_key", "label_key", "metadata_key",
                 "apply_chat_template")
PLACEHOLDER_URL = "http://127.0.0.1:1"
# `rltool serve` flags an in-process engine has no use for (it is no server, and shares the loop
# process's torch threads).
INPROCESS_REFUSED = frozenset({"engine", "model", "url", "host", "port", "ready_file",
                               "num_threads", "api_key", "admin_api_key", "log_level"})


class ModelConfig(StageConfig):
    path: str = Field(description="Initial HF weights directory; copied into the run as "
                      "weights/weight_v000000 (policy version 0).")


class LoopConfig(TrackingConfig):
    num_steps: int = Field(ge=1, description="Loop steps (rollout -> train -> publish -> sync).")
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="colocated: engines release memory while the trainer runs "
        "in the loop process; disaggregated: the trainer runs as its own subprocess while the "
        "engines keep their memory.")
    num_engines: int = Field(1, ge=1, description="Builtin engines to start (each --port 0).")
    engine: Literal["serve", "inprocess"] = Field(
        "serve", description="serve: each engine is an `rltool serve` child reached over HTTP; "
        "inprocess: one builtin engine on a thread of the loop process, called directly and "
        "handed the trainer's tensors by a copy (colocated placement, sync auto or tensor, one "
        "engine).")
    engine_args: list[str] = Field(default_factory=list, description="Extra `rltool serve` "
                                   "arguments for every engine (e.g. [\"--max-running-requests\","
                                   " \"128\"]); in the file or --set loop.engine_args=[...].",
                                   json_schema_extra=cli(option=False))
    engine_ready_timeout_s: float = Field(180.0, gt=0, description="Wait this long for an "
                                          "engine's ready file.")
    deterministic: bool = Field(False, description="Engines --deterministic, trainer "
                                "--deterministic and a fixed rollout seed: a resumed run reaches "
                                "the same weights as an uninterrupted one.")
    seed: int = Field(0, description="Rollout seed when [rollout] sets none, and the trainer "
                      "seed when [train] sets none.")
    save_interval: int = Field(10, ge=1, description="Colocated placement: the resident "
                               "trainer writes a checkpoint every K steps and after the last; "
                               "resume restarts from the newest one and replays the steps after "
                               "it from their rollouts.")
    eval_interval: int | None = Field(None, ge=1, description="Evaluate after every K-th step "
                                      "and after the last one (needs an [eval] table).")
    align_gate: float | None = Field(None, ge=0.0, description="Stop with exit 1 when "
                                     "train/train_rollout_logprob_abs_diff exceeds this.")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: rollout, train and weight sync take turns; async: engines "
        "generate continuously, the trainer steps whenever a batch of groups is ready and new "
        "weights reach the engines without draining them (needs --placement disaggregated).")
    update_mode: Literal["in-place", "retract", "abort"] = Field(
        "in-place", description="Async: what a weight update does to requests in flight: "
        "in-place keeps their cache and tokens, retract re-prefills them (tokens kept), abort "
        "regenerates them from scratch.")
    max_staleness: int = Field(1, ge=0, description="Async: train no sample whose oldest token "
                               "is more than K policy versions older than the version training "
                               "on it (backpressure on the rollout side, drops counted).")
    engine_cores: list[int] | None = Field(None, description="Pin every engine to these CPU "
                                           "cores (os.sched_setaffinity).")
    trainer_cores: list[int] | None = Field(None, description="Pin the loop process (the "
                                            "resident trainer, the rollout client) to these "
                                            "CPU cores.")


class LoopSettings(BaseModel):
    """The validated tables of one loop config."""

    model: ModelConfig
    rollout: dict[str, Any]
    train: dict[str, Any]
    sync: SyncConfig
    eval: dict[str, Any] | None
    loop: LoopConfig

    @classmethod
    def from_file(cls, path: str | Path, *, overrides: dict[str, dict[str, Any]] | None = None
                  ) -> "LoopSettings":
        return cls.from_tables(read_toml(path), overrides=overrides)

    @classmethod
    def from_tables(cls, data: dict[str, Any], *,
                    overrides: dict[str, dict[str, Any]] | None = None) -> "LoopSettings":
        tables: dict[str, dict[str, Any]] = {}
        for name in ("model", "rollout", "train", "sync", "eval", "loop"):
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
        model = _validate(ModelConfig, tables["model"], "model")
        if not (Path(model.path) / "config.json").is_file():
            raise ConfigError(f"[model] path {model.path!r} is not a HF weights directory "
                              "(no config.json)")
        loop = _validate(LoopConfig, tables["loop"], "loop")
        settings = cls(model=model, rollout=tables["rollout"], train=tables["train"],
                       sync=_validate(SyncConfig, tables["sync"], "sync"),
                       eval=tables["eval"] or None, loop=loop)
        if loop.mode == "async" and loop.placement == "colocated":
            raise ConfigError("--mode async generates while the trainer trains, so engines and "
                              "trainer need resources of their own: use --placement "
                              "disaggregated (and --engine-cores/--trainer-cores on one host)")
        if loop.mode == "async" and (settings.rollout.get("filter", "none") != "none"
                                     or settings.rollout.get("partial")):
            raise ConfigError("--mode async trains every finished group in completion order: "
                              "remove [rollout] filter and partial")
        for option, cores in (("engine-cores", loop.engine_cores),
                              ("trainer-cores", loop.trainer_cores)):
            if cores is not None:
                check_cores(cores, option=option)
        if settings.sync.sync in ("tensor", "distributed") and loop.placement != "colocated" \
                and loop.mode != "async":
            raise ConfigError(f"--sync {settings.sync.sync} hands weights to engines on the "
                              "trainer's host: use --placement colocated, or --sync full, delta "
                              "or auto")
        if loop.engine == "inprocess":
            settings.serve_config(model.path)
        if loop.eval_interval is not None and settings.eval is None:
            raise ConfigError("[loop] eval_interval needs an [eval] table with prompts = FILE")
        # Validate every stage with placeholder values for the keys the loop owns.
        placeholder = RunDir("/nonexistent-run")
        settings.rollout_config(placeholder, step=0, urls=[PLACEHOLDER_URL])
        settings.train_config(placeholder, step=0, load=model.path)
        if settings.eval is not None:
            settings.eval_config(placeholder, step=0, urls=[PLACEHOLDER_URL], policy_version=0)
        return settings

    def to_tables(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model.model_dump(mode="json", exclude_none=True),
                               "rollout": dict(self.rollout), "train": dict(self.train),
                               "sync": self.sync.model_dump(mode="json", exclude_none=True),
                               "loop": self.loop.model_dump(mode="json", exclude_none=True)}
        if self.eval is not None:
            out["eval"] = dict(self.eval)
        return out

    # ----- per-step stage configs ----------------------------------------------------------

    def rollout_config(self, run: RunDir, *, step: int, urls: list[str]) -> RolloutConfig:
        values = dict(self.rollout)
        values.setdefault("seed", self.loop.seed if self.loop.deterministic else None)
        values.update(engines=urls, out=str(run.rollout_step(step)), step=step, quiet=True,
                      metrics=str(run.metrics_file("rollout")))
        return _validate(RolloutConfig, values, "rollout")

    def eval_config(self, run: RunDir, *, step: int, urls: list[str],
                    policy_version: int) -> EvalConfig:
        assert self.eval is not None
        values = {k: self.rollout[k] for k in EVAL_INHERITS if k in self.rollout}
        values.update(self.eval)
        values.update(engines=urls, out=str(run.eval_step(step)), step=step, quiet=True,
                      metrics=str(run.metrics_file("eval")), policy_version=policy_version)
        return _validate(EvalConfig, values, "eval")

    def train_config(self, run: RunDir, *, step: int, load: str) -> TrainConfig:
        values = dict(self.train)
        values.setdefault("seed", self.loop.seed)
        if self.loop.deterministic:
            values["deterministic"] = True
        values.update(rollouts=[str(run.rollout_step(step))], load=load, save=str(run.ckpt),
                      metrics=str(run.metrics_file("train")))
        return _validate(TrainConfig, values, "train")

    def serve_config(self, model_dir: str | Path) -> ServeConfig:
        """The in-process engine's settings: `engine_args` read as `rltool serve` flags
        (`--max-running-requests 128`, `--dtype bf16`, a bare flag is true), for `model_dir`."""
        loop = self.loop
        if loop.placement != "colocated" or loop.num_engines != 1 or self.sync.sync not in (
                "auto", "tensor"):
            raise ConfigError("[loop] engine = \"inprocess\" runs one engine in the loop "
                              "process: it needs placement = \"colocated\", num_engines = 1 and "
                              "[sync] sync = \"auto\" or \"tensor\"; or use engine = \"serve\"")
        values: dict[str, Any] = {}
        args = list(loop.engine_args)
        while args:
            flag = args.pop(0)
            key = flag[2:].replace("-", "_")
            if not flag.startswith("--") or key in INPROCESS_REFUSED:
                raise ConfigError(f"[loop] engine_args: {flag!r} is not an in-process engine "
                                  f"option (not a flag, or one of {sorted(INPROCESS_REFUSED)}, "
                                  "which only a server has)")
            values[key] = args.pop(0) if args and not args[0].startswith("--") else True
        values.update(engine="builtin", model=str(model_dir))
        values["deterministic"] = loop.deterministic or bool(values.get("deterministic", False))
        return _validate(ServeConfig, values, "loop.engine_args")

    def is_eval_step(self, step: int) -> bool:
        k = self.loop.eval_interval
        if k is None or self.eval is None:
            return False
        return (step + 1) % k == 0 or step == self.loop.num_steps - 1


def _validate(model: type[Any], values: dict[str, Any], section: str) -> Any:
    try:
        return model(**values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, section=section)) from e


def parse_set_options(items: list[str] | tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """`--set table.key=value` (the value parsed as TOML, else kept as a string) ->
    {table: {key: value}}."""
    import tomllib

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, eq, raw = item.partition("=")
        table, dot, key = name.strip().partition(".")
        if not eq or not dot or not key:
            raise ConfigError(f"--set {item!r}: use --set TABLE.KEY=VALUE, e.g. "
                              "--set rollout.rollout_batch_size=16")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        out.setdefault(table, {})[key.replace("-", "_")] = value
    return out
