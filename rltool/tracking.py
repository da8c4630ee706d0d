"""Experiment tracking: TensorBoard and Weights & Biases mirror a run's metrics JSONL files.

The JSONL files (`RUN/metrics/<stage>.jsonl`) stay the source of truth; trackers only copy their
rows, after each loop step, under the same (slime's) metric names. Each stage's rows go on its own
x-axis, as slime defines them in W&B: `rollout/step` for rollout rows and the loop's own keys,
`train/step` (optimizer steps) for train rows, which also carry `rollout/step`, and `eval/step`
for eval rows, whose keys all go under `eval/` (eval's `perf/tokens_per_sec` becomes
`eval/perf/tokens_per_sec`, apart from rollout's). From loop.jsonl only the keys no stage file
holds are mirrored (`perf/loop/...`, `sync/...`): its `rollout/...`, `train/...` and `eval/...`
copies would be the same points twice. TensorBoard gets each value as a scalar at its axis step.

Off by default. A tracker that fails (at start or on a row) logs one warning and is off for the
rest of the run; the run itself never stops for it.
"""

from __future__ import annotations

import importlib.util
import logging
import secrets
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from rltool import atomic
from rltool.config import StageConfig, without_secrets
from rltool.rundir import RunDir, read_json_file, read_metrics

log = logging.getLogger(__name__)
STAGES = ("rollout", "train", "eval", "loop")
AXES = {"rollout": "rollout/step", "train": "train/step", "eval": "eval/step",
        "loop": "rollout/step"}
STAGE_PREFIXES = ("rollout/", "train/", "eval/")
SKIPPED = ("step", "policy_version", "time", "rollout_step")


class TrackingConfig(StageConfig):
    """Where a loop mirrors its metrics (fields of `[loop]`)."""

    tensorboard: str | None = Field(None, description="Also write the metrics as TensorBoard "
                                    "scalars to this directory (needs `rltool[track]`).")
    wandb_project: str | None = Field(None, description="Also log the metrics to this Weights & "
                                      "Biases project (needs `rltool[track]`; WANDB_MODE=offline "
                                      "writes RUN/wandb/ only).")
    wandb_name: str | None = Field(None, description="W&B run name (default: the run "
                                   "directory's name).")

    @model_validator(mode="after")
    def _packages_installed(self) -> "TrackingConfig":
        for flag, value, package in (("--tensorboard", self.tensorboard, "tensorboard"),
                                     ("--wandb-project", self.wandb_project, "wandb")):
            if value and importlib.util.find_spec(package) is None:
                raise ValueError(f"{flag} needs the {package} package: pip install "
                                 "'rltool[track]'")
        if self.tensorboard and Path(self.tensorboard).is_file():
            raise ValueError(f"--tensorboard {self.tensorboard} is a file; pass a directory")
        return self


def mirrored(stage: str, row: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """(axis step, {metric name: value}) of one metrics row of `stage`, axis keys included."""
    values: dict[str, float] = {}
    for key, value in row.items():
        if key in SKIPPED or not isinstance(value, (int, float)):
            continue
        if stage == "loop" and key.startswith(STAGE_PREFIXES):
            continue
        if stage == "eval" and not key.startswith("eval/"):
            key = f"eval/{key}"
        values[key] = float(value)
    step = int(row["step"])
    values[AXES[stage]] = float(step)
    if stage == "train" and isinstance(row.get("rollout_step"), int):
        values["rollout/step"] = float(row["rollout_step"])
    return step, values


class _TensorBoard:
    def __init__(self, logdir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=logdir)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            if key not in AXES.values():
                self.writer.add_scalar(key, value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, *, project: str, name: str, run_id: str, directory: Path,
                 config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow",
                              dir=str(directory), config=config)
        for axis in sorted(set(AXES.values())):
            self.run.define_metric(axis)
        self.run.define_metric("train/*", step_metric="train/step")
        self.run.define_metric("eval/*", step_metric="eval/step")
        for prefix in ("rollout/*", "perf/*", "sync/*"):
            self.run.define_metric(prefix, step_metric="rollout/step")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values)

    def flush(self) -> None:
        """W&B sends on its own."""

    def close(self) -> None:
        self.run.finish()


class Tracker:
    """The configured backends; each one that fails warns once and is dropped."""

    def __init__(self, cfg: TrackingConfig, *, run: RunDir, config: dict[str, Any]):
        self.backends: dict[str, Any] = {}
        if cfg.tensorboard:
            self._start("tensorboard", lambda: _TensorBoard(str(cfg.tensorboard)))
        if cfg.wandb_project:
            project = cfg.wandb_project
            self._start("wandb", lambda: _Wandb(
                project=project, name=cfg.wandb_name or run.root.resolve().name,
                run_id=wandb_run_id(run), directory=run.root, config=without_secrets(config)))

    def _start(self, name: str, make: Any) -> None:
        try:
            self.backends[name] = make()
        except Exception as e:  # noqa: BLE001 - a tracker never stops a run
            self._failed(name, e, when="starting")

    def _failed(self, name: str, error: BaseException, *, when: str) -> None:
        self.backends.pop(name, None)
        log.warning("%s tracking failed while %s (%s: %s); it is off for the rest of this run "
                    "(the metrics JSONL files hold every value)", name, when,
                    type(error).__name__, error)

    def log(self, stage: str, row: dict[str, Any]) -> None:
        step, values = mirrored(stage, row)
        for name, backend in list(self.backends.items()):
            try:
                backend.log(step, values)
            except Exception as e:  # noqa: BLE001
                self._failed(name, e, when=f"logging a {stage} row")

    def flush(self) -> None:
        self._each("flush", when="flushing")

    def close(self) -> None:
        self._each("close", when="closing")
        self.backends.clear()

    def _each(self, method: str, *, when: str) -> None:
        for name, backend in list(self.backends.items()):
            try:
                getattr(backend, method)()
            except Exception as e:  # noqa: BLE001
                self._failed(name, e, when=when)


def wandb_run_id(run: RunDir) -> str:
    """The run's W&B id, kept in RUN/tracking.json so a resumed loop continues the same W&B run."""
    data = read_json_file(run.tracking, what="tracking.json") or {}
    run_id = data.get("wandb_run_id")
    if not isinstance(run_id, str) or not run_id:
        run_id = secrets.token_hex(8)
        atomic.write_json(run.tracking, {**data, "wandb_run_id": run_id})
    return run_id


class MetricsMirror:
    """Copies the rows a run's metrics files gained since the last `poll()` to a Tracker.

    Rows of loop steps before `from_step` (a resumed run's earlier steps, mirrored by the loop
    that ran them) are skipped; a train row's loop step is its `rollout_step` (rows without one,
    the publish rows, go with the row before them)."""

    def __init__(self, tracker: Tracker, run: RunDir, *, from_step: int):
        self.tracker, self.run, self.from_step = tracker, run, from_step
        self.seen = dict.fromkeys(STAGES, 0)
        self.loop_step = dict.fromkeys(STAGES, -1)

    def poll(self) -> int:
        """Mirror the new rows of every stage's file; returns how many were sent."""
        if not self.tracker.backends:
            return 0
        sent = 0
        for stage in STAGES:
            rows = read_metrics(self.run.metrics_file(stage))
            for row in rows[self.seen[stage]:]:
                loop_step = row.get("rollout_step" if stage == "train" else "step")
                if isinstance(loop_step, int):
                    self.loop_step[stage] = loop_step
                if self.loop_step[stage] >= self.from_step:
                    self.tracker.log(stage, row)
                    sent += 1
            self.seen[stage] = len(rows)
        self.tracker.flush()
        return sent


def open_mirror(cfg: TrackingConfig, run: RunDir, *, from_step: int,
                config: dict[str, Any]) -> MetricsMirror | None:
    """A mirror for a loop run, or None when no tracker is configured."""
    if not (cfg.tensorboard or cfg.wandb_project):
        return None
    return MetricsMirror(Tracker(cfg, run=run, config=config), run, from_step=from_step)
