"""Shards the rollout worker wrote ahead of the step in progress are not committed: a resumed run
removes them (and only them) before anything generates."""

from __future__ import annotations

from rltool.loop.async_runner import discard_prepared
from rltool.rundir import RunDir


def test_discard_prepared_removes_only_shards_after_the_step(tmp_path):
    run = RunDir(tmp_path / "run")
    for step in range(4):
        run.rollout_step(step).mkdir(parents=True)
        (run.rollout_step(step) / "MANIFEST.json").write_text("{}")
    discard_prepared(run, 1)
    assert sorted(p.name for p in run.rollouts.iterdir()) == [run.rollout_step(0).name,
                                                                run.rollout_step(1).name]
    discard_prepared(run, 1)  # nothing ahead: a no-op
    assert len(list(run.rollouts.iterdir())) == 2
