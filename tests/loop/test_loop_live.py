"""The whole loop on CPU with live engines: resume after SIGKILL at every phase boundary reaches
the same final weights as an uninterrupted run (deterministic mode; the resident trainer replays
the steps after its last checkpoint), delta sync from disk and tensor sync in memory agree,
Ctrl-C ends the children, `rltool report` plots the run, TensorBoard and W&B (offline) mirror its
metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import tomli_w
from click.testing import CliRunner

from rltool.cli import main as cli
from rltool.data.tasks import make_rows, write_prompts
from rltool.rundir import RunDir, read_metrics

pytestmark = pytest.mark.slow
NUM_STEPS = 2
# Every phase boundary the loop records, in order; the chained run is killed at each one:
# (RLTOOL_KILL_AT, then the step and the last recorded phase in state.json). A kill point counts
# its calls per process, and each run after the first resumes where the previous was killed.
KILL_POINTS = (("loop.rollout:1", 0, "rollout"), ("loop.train:1", 0, "train"),
               ("loop.publish:1", 0, "publish"), ("loop.sync:1", 0, "sync"),
               ("loop.start:2", 1, None),  # step 0 (resumed after its sync), then step 1
               ("loop.rollout:1", 1, "rollout"), ("loop.eval:1", 1, "eval"))


@pytest.fixture(scope="module")
def loop_config(tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("loop")
    write_prompts(make_rows("reverse", num=8, seed=1), root / "rl.jsonl")
    write_prompts(make_rows("reverse", num=2, seed=2), root / "eval.jsonl")
    config = {
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"prompts": str(root / "rl.jsonl"), "reward": "reverse:partial",
                    "n_samples_per_prompt": 2, "rollout_batch_size": 2, "max_response_len": 6},
        "train": {"lr": 1e-2, "global_batch_size": 2},
        "sync": {"sync": "full"},
        "eval": {"prompts": str(root / "eval.jsonl"), "n_samples_per_prompt": 2},
        "loop": {"num_steps": NUM_STEPS, "deterministic": True, "seed": 3, "eval_interval": 2,
                 "align_gate": 1.0},
    }
    path = root / "run.toml"
    path.write_text(tomli_w.dumps(config))
    return path


def loop_cli(*args: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RLTOOL_KILL_AT", None)
    if kill_at:
        env["RLTOOL_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "rltool", "loop", "-q", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def final_model_bytes(run: Path) -> bytes:
    ckpt = RunDir(run).ckpt_step(newest_version(run))
    return (ckpt / "model" / "model.safetensors").read_bytes()


def newest_version(run: Path) -> int:
    return json.loads((run / "state.json").read_text())["policy_version"]


def served_tensors(run: Path, version: int, scratch: Path) -> dict:
    """The tensors an engine serves for `version` (a delta is rebuilt as the engine would)."""
    from safetensors.torch import load_file

    from rltool.io.checkpoint import is_delta_dir
    from rltool.delta.pull import pull_weights

    path = RunDir(run).weight_version(version)
    if is_delta_dir(path):
        pull_weights(local_checkpoint_dir=scratch, source_dir=RunDir(run).weights,
                     target_version=version)
        path = scratch
    return {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_no_children(run: Path, pids: list[int]) -> None:
    assert RunDir(run).read_engines() == []
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture(scope="module")
def baseline(loop_config, tmp_path_factory) -> Path:
    """Uninterrupted run, disaggregated placement and delta sync (the chained run uses colocated +
    tensor, so equal final weights also show the two placements and sync modes agree), mirrored
    to TensorBoard (RUN/../tb) and W&B in offline mode."""
    run = tmp_path_factory.mktemp("baseline") / "run"
    result = CliRunner(env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}).invoke(
        cli, ["loop", "--config", str(loop_config), "--run-dir", str(run),
              "--placement", "disaggregated", "--sync", "delta", "--json",
              "--tensorboard", str(run.parent / "tb"), "--wandb-project", "rltool-test"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["policy_version"] == newest_version(run)
    return run


def test_uninterrupted_run_writes_every_artifact(baseline):
    run = RunDir(baseline)
    state = json.loads(run.state.read_text())
    assert (state["step"], state["status"]) == (NUM_STEPS, "done")
    rows = read_metrics(run.metrics_file("loop"))
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))
    for r in rows:
        assert {"rollout/raw_reward", "rollout/response_len/mean", "perf/loop/rollout_time",
                "perf/loop/train_time", "train/train_rollout_logprob_abs_diff"} <= set(r)
    assert "eval/mean_reward" in rows[-1] and "eval/mean_reward" not in rows[0]
    assert rows[-1]["sync/mode"] == "delta"
    for step in range(NUM_STEPS):
        assert (run.rollout_step(step) / "_SUCCESS").exists()
    assert (run.eval_step(NUM_STEPS - 1) / "_SUCCESS").exists()
    assert not run.eval_step(0).exists()
    assert [r["step"] for r in read_metrics(run.metrics_file("eval"))] == [NUM_STEPS - 1]
    assert run.read_engines() == []


def test_trackers_mirror_the_loop_metrics(baseline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.helpers.wandb_records import history_and_config

    run = RunDir(baseline)
    loop_rows = read_metrics(run.metrics_file("loop"))
    acc = EventAccumulator(str(baseline.parent / "tb"))
    acc.Reload()
    rewards = acc.Scalars("rollout/raw_reward")
    assert [e.step for e in rewards] == [r["step"] for r in loop_rows]
    assert [e.value for e in rewards] == pytest.approx([r["rollout/raw_reward"] for r in loop_rows])
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == [r["step"] for r in read_metrics(run.metrics_file("train"))
                     if "train/loss" in r]
    assert [e.step for e in acc.Scalars("perf/loop/step_time")] == list(range(NUM_STEPS))
    assert [e.step for e in acc.Scalars("eval/mean_reward")] == [NUM_STEPS - 1]
    (wandb_run,) = (baseline / "wandb").glob("offline-run-*")
    history, config = history_and_config(wandb_run)
    assert [h["rollout/step"] for h in history if "rollout/raw_reward" in h] == list(
        range(NUM_STEPS))
    assert config["loop"]["wandb_project"] == "rltool-test"


def test_resume_after_kill_at_every_phase_matches_uninterrupted(baseline, loop_config, tmp_path):
    run = tmp_path / "run"
    orphans: list[int] = []
    # Checkpoints only at the end: every kill before it resumes by replaying from version 0.
    args = ["--config", str(loop_config), "--run-dir", str(run), "--sync", "tensor"]
    for point, step, phase in KILL_POINTS:
        proc = loop_cli(*args, kill_at=point)
        assert proc.returncode == -signal.SIGKILL, (point, proc.stderr[-2000:])
        state = json.loads((run / "state.json").read_text())
        assert (state["step"], state["phase"]) == (step, phase), point
        engines = RunDir(run).read_engines()
        assert engines and all(psutil.pid_exists(e["pid"]) for e in engines), point
        orphans += [e["pid"] for e in engines]
        args = ["--resume", str(run)]
    proc = loop_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_children(run, orphans)
    # Same samples, nothing lost or duplicated, and bit-identical final weights.
    assert final_model_bytes(run) == final_model_bytes(baseline)
    version = newest_version(run)
    assert version == newest_version(baseline)
    ours = served_tensors(run, version, tmp_path / "a")
    theirs = served_tensors(baseline, version, tmp_path / "b")
    assert ours.keys() == theirs.keys()
    assert all(ours[k].equal(theirs[k]) for k in ours)
    for step in range(NUM_STEPS):
        a = RunDir(run).rollout_step(step) / "_SUCCESS"
        b = RunDir(baseline).rollout_step(step) / "_SUCCESS"
        assert json.loads(a.read_text())["num_rows"] == json.loads(b.read_text())["num_rows"]
        assert uids(RunDir(run).rollout_step(step)) == uids(RunDir(baseline).rollout_step(step))
    assert [r["step"] for r in read_metrics(RunDir(run).metrics_file("loop"))] == [0, 1]
    assert [r["sync/mode"] for r in read_metrics(RunDir(run).metrics_file("loop"))] == \
        ["tensor", "tensor"]
    # killed after its eval was recorded, the last step's row still carries the eval's metrics
    assert "eval/mean_reward" in read_metrics(RunDir(run).metrics_file("loop"))[-1]
    assert sorted(p.name for p in RunDir(run).ckpt.iterdir()) == [f"step-{version:06d}"]
    assert sorted(p.name for p in RunDir(run).weights.glob("weight_v*")) == \
        ["weight_v000000", f"weight_v{version:06d}"]


# Kills inside phases (rltool/faults.py), chained: each resume is killed at the next one.
#  shard.part:1       the loop mid-shard in step 0's rollout (its part written, no marker yet);
#  engine.copy_param:5  the engine mid-weight-update in step 0's sync (the loop then fails);
#  publish.file:9     the loop inside a later publish (checkpoint or weight-version files).
INNER_KILLS = ("shard.part:1", "engine.copy_param:5", "publish.file:9")


def test_resume_after_kills_inside_phases_matches_uninterrupted(baseline, loop_config, tmp_path):
    """SIGKILL inside the rollout (mid-shard), inside the engine's weight update and inside a
    publish: after the final --resume no sample is lost or duplicated and the weights are
    bit-identical to the uninterrupted run's."""
    run = tmp_path / "run"
    orphans: list[int] = []
    args = ["--config", str(loop_config), "--run-dir", str(run)]
    for point in INNER_KILLS:
        proc = loop_cli(*args, kill_at=point)
        assert proc.returncode != 0, (point, proc.stderr[-2000:])
        if point.startswith("engine."):  # the engine died; the loop reports it and stops
            state = json.loads((run / "state.json").read_text())
            assert (state["step"], state["phase"], state["status"]) == (0, "publish", "failed")
        else:
            assert proc.returncode == -signal.SIGKILL, (point, proc.stderr[-2000:])
        for step in range(NUM_STEPS):  # a reader never sees a partial shard
            shard = RunDir(run).rollout_step(step)
            assert not shard.exists() or (shard / "_SUCCESS").exists(), (point, shard)
        orphans += [e["pid"] for e in RunDir(run).read_engines()]
        args = ["--resume", str(run)]
    proc = loop_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_children(run, orphans)
    version = newest_version(run)
    assert version == newest_version(baseline)
    assert final_model_bytes(run) == final_model_bytes(baseline)
    ours = served_tensors(run, version, tmp_path / "a")
    theirs = served_tensors(baseline, version, tmp_path / "b")
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)
    for step in range(NUM_STEPS):
        assert uids(RunDir(run).rollout_step(step)) == uids(RunDir(baseline).rollout_step(step))
    assert [r["step"] for r in read_metrics(RunDir(run).metrics_file("loop"))] == [0, 1]


def test_inprocess_engine_matches_the_served_one_across_a_kill(baseline, loop_config, tmp_path):
    """`--engine inprocess` (the engine on a thread of the loop, weights copied from the resident
    trainer): killed after step 0's train and resumed (the resume replays that step), it samples
    the same uids and reaches the same final weights as the served engines of the baseline;
    nothing is recorded in engines.json, so nothing is left behind."""
    run = tmp_path / "run"
    proc = loop_cli("--config", str(loop_config), "--run-dir", str(run), "--engine", "inprocess",
                    "--sync", "auto", kill_at="loop.train:1")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert RunDir(run).read_engines() == []
    result = CliRunner().invoke(cli, ["loop", "--resume", str(run), "-q"])
    assert result.exit_code == 0, result.output
    assert newest_version(run) == newest_version(baseline)
    assert final_model_bytes(run) == final_model_bytes(baseline)
    for step in range(NUM_STEPS):
        assert uids(RunDir(run).rollout_step(step)) == uids(RunDir(baseline).rollout_step(step))
    rows = read_metrics(RunDir(run).metrics_file("loop"))
    assert [(r["step"], r["sync/mode"]) for r in rows] == [(0, "tensor"), (1, "tensor")]
    assert "eval/mean_reward" in rows[-1]


def uids(shard: Path) -> list[str]:
    from rltool.data.shards import open_shard

    return [u for b in open_shard(shard).iter_batches(columns=["uid"]) for u in
            b.column("uid").to_pylist()]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_ends_the_engines(loop_config, tmp_path, signum):
    run = tmp_path / "run"
    env = dict(os.environ)
    env.pop("RLTOOL_KILL_AT", None)
    proc = subprocess.Popen([sys.executable, "-m", "rltool", "loop", "-q", "--config",
                             str(loop_config), "--run-dir", str(run), "--num-steps", "50"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        pids: list[int] = []
        # Interrupt mid-run (step 1 done), when any phase may be running, asyncio ones included.
        while time.monotonic() < deadline and not pids:
            if (run / "rollouts" / "step-000001" / "_SUCCESS").exists():
                pids = [e["pid"] for e in RunDir(run).read_engines()]
            time.sleep(0.05)
        assert pids, "the loop never got to step 1 with a recorded engine"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        assert_no_children(run, pids)
        assert json.loads((run / "state.json").read_text())["status"] == "failed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_report_writes_plots(baseline, tmp_path):
    result = CliRunner().invoke(cli, ["report", str(baseline), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "rollout/raw_reward" in result.stdout
    names = ("reward.png", "response_len.png", "kl.png", "logprob_diff.png", "step_time.png",
             "eval_by_version.png", "eval_by_time.png")  # the baseline evaluates: its eval plots
    for name in names:
        data = (tmp_path / "r" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    page = (tmp_path / "r" / "index.html").read_text()
    assert page.count("<img") == len(names) and "rollout/raw_reward" in page
