"""Phase helpers that need no engine: the align gate, markers, metrics of a step."""

from __future__ import annotations

import pytest

from rltool.errors import GateFailedError
from rltool.loop import phases
from rltool.loop.config import LoopSettings
from rltool.loop.state import LoopState
from rltool.rundir import MetricsWriter, RunDir
from tests.loop.test_config import tables


def context(run, settings, *, step=0, version=1):
    return phases.StepContext(run=run, settings=settings, engines=None, registry=None,
                              state=LoopState(step=step, policy_version=version))


def log_train(run, *, rollout_step, diffs):
    with MetricsWriter(run.metrics_file("train")) as w:
        for i, d in enumerate(diffs):
            w.log({"train/train_rollout_logprob_abs_diff": d, "rollout_step": rollout_step},
                  step=i + 1, policy_version=i + 1)


def test_align_gate_stops_when_the_metric_breaks_the_tolerance(tiny_model_dir, tmp_path):
    run = RunDir(tmp_path).create()
    settings = LoopSettings.from_tables(tables(tiny_model_dir, loop__align_gate=1e-6))
    log_train(run, rollout_step=0, diffs=[0.0])
    log_train(run, rollout_step=1, diffs=[0.0, 3e-3])
    phases.check_align_gate(context(run, settings, step=0))
    with pytest.raises(GateFailedError, match=r"step 1 has train/train_rollout_logprob_abs_diff "
                       r"= 0.003 > 1e-06") as err:
        phases.check_align_gate(context(run, settings, step=1))
    assert err.value.exit_code == 1
    with pytest.raises(GateFailedError, match="logged no"):
        phases.check_align_gate(context(run, settings, step=2))
    # Without a gate nothing is checked.
    phases.check_align_gate(context(run, LoopSettings.from_tables(tables(tiny_model_dir)),
                                    step=2))


def test_train_metrics_take_the_last_line_of_the_step(tmp_path):
    run = RunDir(tmp_path).create()
    log_train(run, rollout_step=4, diffs=[0.1, 0.2])
    assert phases.train_metrics(run, 4)["train/train_rollout_logprob_abs_diff"] == 0.2
    assert phases.train_metrics(run, 5) == {}


def test_newest_checkpoint_needs_its_marker(tmp_path):
    run = RunDir(tmp_path).create()
    assert phases.newest_checkpoint_version(run) is None
    (run.ckpt_step(2)).mkdir(parents=True)
    (run.ckpt_step(2) / "trainer_state.json").write_text("{}")
    (run.ckpt_step(5)).mkdir()  # interrupted: no marker
    assert phases.newest_checkpoint_version(run) == 2
    assert phases.train_load_path(run, 2) == run.ckpt_step(2)
    assert phases.train_load_path(run, 0) == run.weight_version(0)
