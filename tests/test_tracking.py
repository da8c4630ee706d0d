"""Experiment tracking: TensorBoard and W&B (offline) mirror the metrics JSONL rows on slime's
axes; a resumed run skips the steps mirrored before; a failing tracker warns once and the run
goes on; bad tracking options are refused up front."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from rltool import tracking
from rltool.rundir import MetricsWriter, RunDir
from rltool.tracking import MetricsMirror, Tracker, TrackingConfig
from tests.helpers.wandb_records import history_and_config


def write_step(run: RunDir, step: int) -> None:
    with MetricsWriter(run.metrics_file("rollout")) as w:
        w.log({"rollout/raw_reward": 0.1 * step, "perf/tokens_per_sec": 100.0 + step},
              step=step, policy_version=step)
    with MetricsWriter(run.metrics_file("train")) as w:
        for k in range(2):
            w.log({"train/loss": step + k / 10, "rollout_step": step, "perf/train_time": 0.5},
                  step=2 * step + k + 1, policy_version=2 * step + k + 1)
        w.log({"sync/mode": "full", "perf/update_weights_wire_bytes": 10},
              step=2 * step + 2, policy_version=2 * step + 2)
    if step == 1:
        with MetricsWriter(run.metrics_file("eval")) as w:
            w.log({"eval/mean_reward": 0.25, "perf/tokens_per_sec": 7.0}, step=step,
                  policy_version=2)
    with MetricsWriter(run.metrics_file("loop")) as w:
        w.log({"rollout/raw_reward": 0.1 * step, "perf/loop/step_time": 3.0 + step,
               "sync/mode": "full", "train/grad_norm": 1.0}, step=step, policy_version=2 * step)


def test_mirrored_rows_go_on_slimes_axes():
    _, rollout = tracking.mirrored("rollout", {"step": 3, "policy_version": 1, "time": 1.0,
                                               "rollout/raw_reward": 0.5, "sync/mode": "x"})
    assert rollout == {"rollout/raw_reward": 0.5, "rollout/step": 3.0}
    step, train = tracking.mirrored("train", {"step": 7, "rollout_step": 3, "train/loss": 2,
                                              "policy_version": 7, "time": 0.0})
    assert (step, train) == (7, {"train/loss": 2.0, "train/step": 7.0, "rollout/step": 3.0})
    _, ev = tracking.mirrored("eval", {"step": 3, "eval/pass@1": 1, "perf/eval_time": 2.0})
    assert ev == {"eval/pass@1": 1.0, "eval/perf/eval_time": 2.0, "eval/step": 3.0}
    _, loop = tracking.mirrored("loop", {"step": 3, "rollout/raw_reward": 0.5,
                                         "perf/loop/step_time": 1.5, "eval/pass@1": 1.0})
    assert loop == {"perf/loop/step_time": 1.5, "rollout/step": 3.0}


def test_tensorboard_and_wandb_offline_mirror_a_run(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = RunDir(tmp_path / "run").create()
    cfg = TrackingConfig(tensorboard=str(tmp_path / "tb"), wandb_project="rltool-test")
    config = {"rollout": {"reward": "math", "api_key": "secret"},
              "loop": {"engine_args": ["--api-key", "secret2", "--port", "0"]}}
    mirror = MetricsMirror(Tracker(cfg, run=run, config=config), run, from_step=0)
    assert set(mirror.tracker.backends) == {"tensorboard", "wandb"}
    write_step(run, 0)
    assert mirror.poll() == 5
    assert mirror.poll() == 0  # nothing new: nothing sent twice
    write_step(run, 1)
    assert mirror.poll() == 6
    run_id = (run.tracking.read_text())
    mirror.tracker.close()

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scalars = {tag: [(e.step, round(e.value, 4)) for e in acc.Scalars(tag)]
               for tag in acc.Tags()["scalars"]}
    assert scalars["rollout/raw_reward"] == [(0, 0.0), (1, 0.1)]
    assert scalars["train/loss"] == [(1, 0.0), (2, 0.1), (3, 1.0), (4, 1.1)]
    assert scalars["perf/loop/step_time"] == [(0, 3.0), (1, 4.0)]
    assert scalars["eval/mean_reward"] == [(1, 0.25)]
    assert scalars["eval/perf/tokens_per_sec"] == [(1, 7.0)]
    assert scalars["perf/tokens_per_sec"] == [(0, 100.0), (1, 101.0)]
    assert "train/grad_norm" not in scalars  # the loop's copy of a train value is not repeated

    (run_dir,) = (run.root / "wandb").glob("offline-run-*")
    assert run_dir.name.endswith(tracking.wandb_run_id(run)) and "wandb_run_id" in run_id
    history, logged_config = history_and_config(run_dir)
    rewards = [(h["rollout/step"], h["rollout/raw_reward"]) for h in history
               if "rollout/raw_reward" in h]
    assert rewards == [(0, 0.0), (1, 0.1)]
    assert [(h["train/step"], h["rollout/step"]) for h in history if "train/loss" in h] == [
        (1, 0), (2, 0), (3, 1), (4, 1)]
    assert [h["eval/step"] for h in history if "eval/mean_reward" in h] == [1]
    assert logged_config["rollout"] == {"reward": "math"}  # API keys are not sent
    assert logged_config["loop"] == {"engine_args": ["--api-key", "--port", "0"]}


def test_resumed_mirror_skips_steps_before_it(tmp_path):
    run = RunDir(tmp_path / "run").create()
    write_step(run, 0)
    write_step(run, 1)
    with MetricsWriter(run.metrics_file("rollout")) as w:  # step 2's rollout, then a kill
        w.log({"rollout/raw_reward": 0.9}, step=2, policy_version=4)
    cfg = TrackingConfig(tensorboard=str(tmp_path / "tb"))
    tracker = Tracker(cfg, run=run, config={})
    logged: list[tuple[str, int]] = []
    tracker.log = lambda stage, row: logged.append((stage, row["step"]))  # type: ignore
    assert MetricsMirror(tracker, run, from_step=1).poll() == 7
    assert logged == [("rollout", 1), ("rollout", 2), ("train", 3), ("train", 4), ("train", 4),
                      ("eval", 1), ("loop", 1)]
    tracker.close()


def test_a_failing_tracker_warns_once_and_the_run_goes_on(tmp_path, caplog):
    class Broken:
        calls = 0

        def log(self, step, values):
            Broken.calls += 1
            raise ConnectionError("wandb.ai unreachable")

        def flush(self):
            pass

        def close(self):
            pass

    run = RunDir(tmp_path / "run").create()
    tracker = Tracker(TrackingConfig(tensorboard=str(tmp_path / "tb")), run=run, config={})
    tracker.backends["wandb"] = Broken()
    mirror = MetricsMirror(tracker, run, from_step=0)
    with caplog.at_level(logging.WARNING, logger="rltool.tracking"):
        write_step(run, 0)
        mirror.poll()
        write_step(run, 1)
        mirror.poll()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "wandb tracking failed" in warnings[0]
    assert "ConnectionError: wandb.ai unreachable" in warnings[0]
    assert Broken.calls == 1 and set(tracker.backends) == {"tensorboard"}
    tracker.close()


def test_a_tracker_that_cannot_start_is_off(tmp_path, monkeypatch, caplog):
    import wandb

    def refuse(**kwargs):
        raise RuntimeError("api key not configured")

    monkeypatch.setattr(wandb, "init", refuse)
    run = RunDir(tmp_path / "run").create()
    with caplog.at_level(logging.WARNING, logger="rltool.tracking"):
        tracker = Tracker(TrackingConfig(wandb_project="p"), run=run, config={})
    assert tracker.backends == {}
    assert "while starting (RuntimeError: api key not configured)" in caplog.text
    assert MetricsMirror(tracker, run, from_step=0).poll() == 0


def test_bad_tracking_options_are_refused(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValidationError, match="is a file; pass a directory"):
        TrackingConfig(tensorboard=str(tmp_path / "f"))
    monkeypatch.setattr(tracking.importlib.util, "find_spec",
                        lambda name: None if name == "wandb" else object())
    with pytest.raises(ValidationError, match=r"--wandb-project needs the wandb package: pip "
                       r"install 'rltool\[track\]'"):
        TrackingConfig(wandb_project="p")
    assert tracking.open_mirror(TrackingConfig(), RunDir(tmp_path), from_step=0,
                                config={}) is None
