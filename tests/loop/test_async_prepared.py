"""Shards the rollout worker wrote ahead of the step in progress are not committed: a resumed run
removes them (and only them, with their rollout metrics rows) before anything generates."""

from __future__ import annotations

from rltool.loop.async_runner import discard_prepared
from rltool.rundir import MetricsWriter, RunDir, read_metrics


def test_discard_prepared_removes_only_shards_after_the_step(tmp_path):
    run = RunDir(tmp_path / "run")
    with MetricsWriter(run.metrics_file("rollout")) as writer:
        for step in range(4):
            run.rollout_step(step).mkdir(parents=True)
            (run.rollout_step(step) / "MANIFEST.json").write_text("{}")
            writer.log({"rollout/raw_reward": step / 10}, step=step, policy_version=step)
    discard_prepared(run, 1)
    assert sorted(p.name for p in run.rollouts.iterdir()) == [run.rollout_step(0).name,
                                                                run.rollout_step(1).name]
    rows = read_metrics(run.metrics_file("rollout"))
    assert [(r["step"], r["rollout/raw_reward"]) for r in rows] == [(0, 0.0), (1, 0.1)]
    before = run.metrics_file("rollout").read_bytes()
    discard_prepared(run, 1)  # nothing ahead: a no-op
    assert len(list(run.rollouts.iterdir())) == 2
    assert run.metrics_file("rollout").read_bytes() == before
