"""`rltool loop --mode async` with live engines, killed with SIGKILL at seeded phase boundaries
and resumed each time: no sample is trained twice or lost (every prompt position started is in
one shard, dropped as too stale, or held for regeneration), the final weights are exactly those
of training the committed shards in order, eval runs on its own engine and never takes a
training sample, and the report plots eval against version and wall time."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psutil
import pytest
import tomli_w
from click.testing import CliRunner

from rltool.cli import main as cli
from rltool.rundir import RunDir, read_metrics

from tests.loop.test_loop_live import final_model_bytes, loop_cli, loop_config  # noqa: F401

pytestmark = pytest.mark.slow
NUM_STEPS = 4
# Seeded points: after a batch was written while others were in flight (they are regenerated),
# and after a train past the checkpoint of step 1 (the resident trainer replays steps 2 and 3).
# Eval runs after the last step only, so only the final run starts the eval engine. Kill points
# count per process: the second run resumes after step 1's rollout. Each point with the step and
# phase state.json holds when it fires.
KILL_POINTS = (("loop.rollout:2", 1, "rollout"), ("loop.train:3", 3, "train"))


@pytest.fixture(scope="module")
def async_config(loop_config, tmp_path_factory) -> Path:  # noqa: F811
    """The synchronous live test's config, run asynchronously for more steps."""
    import tomllib

    config = tomllib.loads(loop_config.read_text())
    config["sync"] = {"sync": "tensor"}
    config["train"]["global_batch_size"] = 4  # one optimizer step (version) per batch
    config["loop"].update(num_steps=NUM_STEPS, placement="disaggregated", mode="async",
                          update_mode="retract", max_staleness=1, save_interval=2,
                          eval_interval=NUM_STEPS, engine_args=["--num-threads", "1"])
    del config["loop"]["align_gate"]
    path = tmp_path_factory.mktemp("async") / "run.toml"
    path.write_text(tomli_w.dumps(config))
    return path


def test_async_refuses_colocated_placement(async_config, tmp_path):
    result = CliRunner().invoke(cli, ["loop", "--config", str(async_config), "--run-dir",
                                      str(tmp_path / "run"), "--placement", "colocated"])
    assert result.exit_code == 2
    assert "--placement disaggregated" in result.output
    assert not (tmp_path / "run").exists()


def shard_rows(path: Path) -> list[dict]:
    from rltool.data.shards import open_shard

    return [r for b in open_shard(path).iter_batches(columns=["uid", "group_id", "metadata"])
            for r in b.to_pylist()]


def async_meta(path: Path) -> dict:
    from rltool.data.shards import open_shard

    return open_shard(path).meta.extra["async"]


def test_kill_and_resume_trains_each_sample_once(async_config, tmp_path):
    run_dir = tmp_path / "run"
    run = RunDir(run_dir)
    args = ["--config", str(async_config), "--run-dir", str(run_dir)]
    orphans: list[int] = []
    for point, step, phase in KILL_POINTS:
        proc = loop_cli(*args, kill_at=point)
        assert proc.returncode == -signal.SIGKILL, (point, proc.stderr[-2000:])
        state = json.loads(run.state.read_text())
        assert (state["step"], state["phase"]) == (step, phase), point
        orphans += [e["pid"] for e in run.read_engines()]
        args = ["--resume", str(run_dir)]
    proc = loop_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run.read_engines() == []
    for pid in orphans:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    state = json.loads(run.state.read_text())
    assert (state["step"], state["status"], state["policy_version"]) == (NUM_STEPS, "done",
                                                                         NUM_STEPS)

    # No sample trained twice; every position started is accounted for.
    uids, positions, dropped = [], [], []
    for step in range(NUM_STEPS):
        rows = shard_rows(run.rollout_step(step))
        uids += [r["uid"] for r in rows]
        positions += sorted({r["group_id"] for r in rows})
        dropped += async_meta(run.rollout_step(step))["dropped"]
    assert len(uids) == len(set(uids)) == NUM_STEPS * 2 * 2
    assert len(positions) == len(set(positions))
    last = async_meta(run.rollout_step(NUM_STEPS - 1))
    accounted = set(positions) | set(dropped) | set(last["held"])
    assert set(range(last["next_position"])) == accounted

    rows = read_metrics(run.metrics_file("loop"))
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))
    # one rollout row per step: those of batches written ahead by a killed worker went with them
    assert [r["step"] for r in read_metrics(run.metrics_file("rollout"))] == list(range(NUM_STEPS))
    # the first step after each resume reports the held positions of the newest shard it found
    held_at_kill = [len(async_meta(run.rollout_step(1))["held"]),
                    len(async_meta(run.rollout_step(3))["held"])]
    reported = [rows[1].get("resume/regenerated_groups", 0),
                rows[3].get("resume/regenerated_groups", 0)]
    assert reported == held_at_kill
    for r in rows:
        assert r["staleness/max"] <= 1
        assert {"update/retracted", "staleness/dropped", "staleness/token_age_hist"} <= set(r)

    # The final weights are those of training the committed shards in order (replayed here).
    from rltool.loop.config import LoopSettings
    from rltool.train.resident import ResidentTrainer

    settings = LoopSettings.from_file(run.config)
    trainer = ResidentTrainer(settings.train_config(run, step=0, load=str(run.weight_version(0))))
    for step in range(NUM_STEPS):
        trainer.train(settings.train_config(run, step=step, load=str(run.weight_version(0))),
                      loop_step=step, log_metrics=False)
    replay = tmp_path / "replay"
    trainer.save(replay)
    assert (replay / f"step-{NUM_STEPS:06d}" / "model" / "model.safetensors").read_bytes() == \
        final_model_bytes(run_dir)

    # Eval: its own engine and prompts; rows tagged with the version they measured.
    evals = read_metrics(run.metrics_file("eval"))
    assert evals and evals[-1]["policy_version"] == NUM_STEPS
    assert (run.log_file("eval-engine-0")).exists()
    for row in evals:
        eval_rows = shard_rows(run.eval_step(row["policy_version"]))
        assert eval_rows and all(r["uid"].startswith("eval") for r in eval_rows)
        assert not {r["uid"] for r in eval_rows} & set(uids)
    report = CliRunner().invoke(cli, ["report", str(run_dir), "--json"])
    assert report.exit_code == 0, report.output
    plots = {Path(p).name for p in json.loads(report.stdout)["plots"]}
    assert {"eval_by_version.png", "eval_by_time.png", "staleness.png"} <= plots
