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
`LoopSettings.from_tables` reads every table into its stage's typed config up front, once (bad
input changes nothing on disk; rltool.loop.settings builds them and checks the combinations);
per step the loop fills the keys it owns with `rollout_config(run, step=..., urls=...)` etc.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from rltool.config import (StageConfig, checked_urls, cli, is_secret_key, read_toml,
                           without_secrets)
from rltool.delta.config import SyncConfig
from rltool.engine.config import ServeConfig, resolve_device
from rltool.errors import ConfigError
from rltool.loop.keys import take_engine_keys
from rltool.loop.settings import (check_settings, eval_table, read_tables, rollout_table,
                                  train_table, validate)
from rltool.rollout.eval import EvalConfig
from rltool.rollout.stage import RolloutConfig, split_urls
from rltool.rundir import RunDir
from rltool.tracking import TrackingConfig
from rltool.train.config import TrainConfig

# `rltool serve` flags an in-process engine has no use for (it is no server, and shares the loop
# process's torch threads).
INPROCESS_REFUSED = frozenset({"engine", "model", "url", "host", "port", "ready_file",
                               "num_threads", "api_key", "admin_api_key", "log_level",
                               "allowed_hosts", "allowed_sync_hosts"})


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
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the engines and the trainer run unless engine_args --device "
        "or [train] device say otherwise (auto: CUDA when torch sees one), in bf16 on CUDA "
        "unless --dtype or [train] dtype say otherwise. Colocated on CUDA they take turns on "
        "the device: the trainer's parameters, gradients and optimizer state wait in pinned "
        "host memory during rollout and eval, the engines release weights and KV pool during "
        "training.")
    offload: Literal["auto", "all", "optimizer", "none"] = Field(
        "auto", description="Colocated on CUDA: what the trainer moves to pinned host memory "
        "during rollout and eval (its gradients are freed): all (parameters and optimizer "
        "state), optimizer (its state only; the fp32 parameters stay on the device), auto (all "
        "when the host has room for it, else optimizer; rltool.train.memplan's plan, which "
        "refuses one that does not fit), none (nothing moves and nothing alternates: trainer "
        "and engines stay on the device together, for models small enough; cap the engines' KV "
        "pool with engine_args --max-total-tokens or --mem-fraction-static).")
    min_kv_tokens: int = Field(65536, ge=1, description="Colocated on CUDA: the KV pool "
                               "(tokens) the engines need at least beside what the trainer "
                               "leaves on the device during rollout; the memory plan checks it.")
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
    use_rollout_routing_replay: bool = Field(
        False, description="MoE models (R3): rollouts ask the engines for the experts they "
        "routed every token to and the trainer replays them (rollout and train "
        "--use-rollout-routing-replay).")
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
    launcher: Literal["local", "ray"] = Field(
        "local", description="local: engines are child processes of the loop; ray: engines and "
        "the trainer run in Ray actors placed with placement groups (docs/cluster.md).")
    ray_address: str | None = Field(None, description="--launcher ray: the Ray cluster to join "
                                    "(\"auto\": the one `ray start` made on this node); default: "
                                    "a local Ray instance for this run.")
    ray_num_cpus: int | None = Field(None, ge=1, description="--launcher ray, local instance: its "
                                     "logical CPUs (default: one per engine and per trainer rank).")
    ray_engine_gpus: float = Field(0.0, ge=0.0, description="--launcher ray: GPUs per engine "
                                   "bundle (colocated: shared with the trainer).")
    ray_trainer_gpus: float = Field(0.0, ge=0.0, description="--launcher ray, disaggregated: "
                                    "GPUs of the trainer's bundle.")
    ray_trainer_ranks: int = Field(1, ge=1, description="--launcher ray: trainer processes "
                                   "(torchrun inside the trainer actor when more than one).")
    ray_max_restarts: int = Field(3, ge=0, description="--launcher ray: how often Ray restarts "
                                  "a dead engine actor (its requests go to the other engines).")
    engine_urls: list[str] | None = Field(None, description="External engines: base URLs of "
                                          "running engines the loop drives but neither starts "
                                          "nor stops (instead of num_engines/engine_args).",
                                          json_schema_extra=cli(metavar="URL[,URL...]"))
    router_url: str | None = Field(None, description="External engines behind an smg gateway "
                                   "(started with --enable-rl): rollouts go through it, weight "
                                   "updates to the workers it lists at /v1/rl/workers.")
    api_key: str | None = Field(None, description="Bearer key of the external engines (or "
                                "gateway); [rollout] and [eval] use it when they set none. Not "
                                "written to the run's config.toml.",
                                json_schema_extra=cli(envvar="RLTOOL_API_KEY"))
    admin_api_key: str | None = Field(None, description="Admin key of the engines: the "
                                      "external ones' weight, pause and memory routes (default: "
                                      "api_key); the engines the loop starts serve with it (and "
                                      "api_key). Sent to no gateway or teacher. Not written to "
                                      "the run's config.toml.",
                                      json_schema_extra=cli(envvar="RLTOOL_ADMIN_API_KEY"))
    admin_key_hosts: list[str] = Field(default_factory=list, description="router_url: the "
                                       "hosts (HOST, any port, or HOST:PORT) of the gateway's "
                                       "workers that may receive the admin key; a worker the "
                                       "gateway lists elsewhere is refused.",
                                       json_schema_extra=cli(metavar="HOST[,HOST:PORT...]"))
    opd_teacher_api_key: str | None = Field(None, description="Bearer key of the [rollout] "
                                            "opd_teacher engines (never api_key or "
                                            "admin_api_key). Not written to the run's "
                                            "config.toml.",
                                            json_schema_extra=cli(
                                                envvar="RLTOOL_OPD_TEACHER_API_KEY"))
    engine_local_dir: str | None = Field(None, description="Delta sync with external engines "
                                         "or Ray actors: the directory on the engines' hosts "
                                         "where /pull_weights rebuilds versions (their "
                                         "--local-checkpoint-dir; default RUN/engine_local).")
    trainer_launcher: list[str] = Field(default_factory=list, description="Disaggregated "
                                        "placement: the command that runs a Python module, "
                                        "before `rltool train --config FILE` (default: this "
                                        "Python's `-m`), e.g. [\"torchrun\", \"--nnodes=2\", "
                                        "..., \"-m\"] for a multi-node trainer.",
                                        json_schema_extra=cli(option=False))
    sync_master_address: str = Field("127.0.0.1", description="--sync distributed: the "
                                     "address of this host the engines reach to join the weight "
                                     "broadcast (on several nodes, the loop node's address).")

    @model_validator(mode="before")
    @classmethod
    def _engine_keys(cls, data: Any) -> Any:
        return take_engine_keys(data)

    @field_validator("engine_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        return split_urls(value)

    @field_validator("engine_urls", "router_url")
    @classmethod
    def _check_urls(cls, value: list[str] | str | None) -> list[str] | str | None:
        return checked_urls(value)

    @model_validator(mode="after")
    def _external_or_started(self) -> "LoopConfig":
        if self.engine_urls and self.router_url:
            raise ValueError("give one of engine_urls (engines the loop drives directly) and "
                             "router_url (a gateway in front of them), not both")
        started = sorted({"num_engines", "engine_args"} & self.model_fields_set)
        if self.external and started:
            raise ValueError(f"{' and '.join(started)} configure engines the loop starts, but "
                             "engine_urls/router_url name engines it does not start; remove one "
                             "of the two")
        if self.mode == "async" and (self.external or self.launcher == "ray"):
            raise ValueError("the asynchronous loop starts its own engines: use --mode sync with "
                             "engine_urls/router_url or --launcher ray")
        if self.admin_key_hosts and not self.router_url:
            raise ValueError("admin_key_hosts names the gateway workers that may receive the "
                             "admin key; it needs router_url (engine_urls name their engines "
                             "themselves)")
        if self.external and self.launcher == "ray":
            raise ValueError("--launcher ray starts the engines in Ray actors; external engines "
                             "(engine_urls/router_url) take --launcher local")
        return self

    @property
    def external(self) -> bool:
        """The engines are not the loop's: it neither starts nor stops them."""
        return bool(self.engine_urls or self.router_url)


class LoopSettings(BaseModel):
    """The validated tables of one loop config, typed: [rollout], [train] and [eval] are their
    stages' configs as every step gets them, but for the keys the loop decides per step, which
    hold placeholders until `rollout_config`, `train_config` and `eval_config` fill them
    (rltool.loop.settings)."""

    model: ModelConfig
    rollout: RolloutConfig
    train: TrainConfig
    sync: SyncConfig
    eval: EvalConfig | None
    loop: LoopConfig
    # The stage tables as written (with --set applied), which the run's config.toml keeps: a
    # resumed run's overrides then meet the same defaults and validator choices (the typed
    # configs also hold the loop's values, what [eval] inherits and what validators filled in).
    _tables: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)

    @classmethod
    def from_file(cls, path: str | Path, *, overrides: dict[str, dict[str, Any]] | None = None
                  ) -> "LoopSettings":
        return cls.from_tables(read_toml(path), overrides=overrides)

    @classmethod
    def from_tables(cls, data: dict[str, Any], *,
                    overrides: dict[str, dict[str, Any]] | None = None) -> "LoopSettings":
        tables = read_tables(data, overrides=overrides)
        model = validate(ModelConfig, tables["model"], "model")
        if not (Path(model.path) / "config.json").is_file():
            raise ConfigError(f"[model] path {model.path!r} is not a HF weights directory "
                              "(no config.json)")
        loop = validate(LoopConfig, tables["loop"], "loop")
        try:
            device = resolve_device(loop.device)
        except ValueError as e:
            raise ConfigError(f"[loop] device: {e}") from e
        sync = validate(SyncConfig, tables["sync"], "sync")
        rollout = rollout_table(tables["rollout"], loop=loop)
        settings = cls(model=model, rollout=rollout, sync=sync, loop=loop,
                       train=train_table(tables["train"], loop=loop, device=device,
                                         load=model.path),
                       eval=eval_table(tables["eval"], rollout=rollout,
                                       rollout_keys=tuple(tables["rollout"]), loop=loop)
                       if tables["eval"] else None)
        settings._tables = {name: tables[name] for name in ("rollout", "train", "eval")}
        check_settings(settings)
        return settings

    def to_tables(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model.model_dump(mode="json", exclude_none=True),
                               "rollout": without_secrets(self._tables["rollout"]),
                               "train": dict(self._tables["train"]),
                               "sync": self.sync.model_dump(mode="json", exclude_none=True),
                               "loop": self.loop.model_dump(mode="json", exclude_none=True,
                                                            exclude=_unsaved(self.loop))}
        if self.eval is not None:
            out["eval"] = without_secrets(self._tables["eval"])
        return out

    # ----- per-step stage configs ----------------------------------------------------------

    def rollout_config(self, run: RunDir, *, step: int, urls: list[str]) -> RolloutConfig:
        return self.rollout.model_copy(deep=True, update={
            **self._engines(urls), "out": str(run.rollout_step(step)), "step": step,
            "metrics": str(run.metrics_file("rollout"))})

    def eval_config(self, run: RunDir, *, step: int, urls: list[str],
                    policy_version: int) -> EvalConfig:
        assert self.eval is not None
        return self.eval.model_copy(deep=True, update={
            **self._engines(urls), "out": str(run.eval_step(step)), "step": step,
            "metrics": str(run.metrics_file("eval")), "policy_version": policy_version})

    def _engines(self, urls: list[str]) -> dict[str, Any]:
        """The engines a step's requests go to (none to set behind a gateway: router_url)."""
        if self.loop.router_url:
            return {}
        engines = split_urls(urls)
        assert engines, "the loop hands every step its engines' URLs"
        return {"engines": engines}

    def train_config(self, run: RunDir, *, step: int, load: str) -> TrainConfig:
        return self.train.model_copy(deep=True, update={
            "rollouts": [str(run.rollout_step(step))], "load": load, "save": str(run.ckpt),
            "metrics": str(run.metrics_file("train"))})

    @property
    def device(self) -> str:
        """[loop] device resolved: "cpu" or "cuda"."""
        return resolve_device(self.loop.device)

    def engine_args(self) -> list[str]:
        """`engine_args` with the loop's device (and bf16 on CUDA) unless they name their own,
        and LoRA serving for a run whose versions are adapters (rltool.loop.lora_sync)."""
        from rltool.loop import lora_sync

        args = list(self.loop.engine_args)
        if "--device" not in args:
            args += ["--device", self.device]
        if "--dtype" not in args and _arg(args, "--device") == "cuda":
            args += ["--dtype", "bf16"]
        return lora_sync.engine_args(self, args)

    @property
    def engine_device(self) -> str:
        """Where the loop's own engines run (their --device, else the loop's)."""
        return resolve_device(_arg(self.engine_args(), "--device") or "auto")

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
        args = self.engine_args()
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
        return validate(ServeConfig, values, "loop.engine_args")

    def is_eval_step(self, step: int) -> bool:
        k = self.loop.eval_interval
        if k is None or self.eval is None:
            return False
        return (step + 1) % k == 0 or step == self.loop.num_steps - 1


def _unsaved(loop: LoopConfig) -> set[str]:
    """[loop] keys the run's config.toml leaves out: the keys (secrets), and the engine-start
    keys of a run with external engines (their defaults would clash with engine_urls)."""
    keys = {name for name in LoopConfig.model_fields if is_secret_key(name)}
    return keys | {"num_engines", "engine_args"} if loop.external else keys


def _arg(args: list[str], flag: str) -> str | None:
    """The value after the last `flag` in a flag list (None when absent or last)."""
    found = None
    for i, item in enumerate(args[:-1]):
        if item == flag:
            found = args[i + 1]
    return found


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
