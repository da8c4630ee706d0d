"""Two nodes simulated on one host, as docs/cluster.md runs them: a rollout node (`rltool serve`
in its own process group and working directory, its /pull_weights directory local to it) and a
trainer node (`rltool loop` driving that engine through `engine_urls`, its trainer under torchrun
(one rank), in another process group and working directory). They share only `shared/`
(model, prompts, config, run directory), as nodes share a filesystem."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tomli_w

from rltool.data.tasks import make_rows, write_prompts
from rltool.rundir import RunDir, read_metrics
from rltool.supervisor import free_port

pytestmark = pytest.mark.slow


def node_env(node: Path) -> dict[str, str]:
    (node / "tmp").mkdir(parents=True, exist_ok=True)
    return dict(os.environ, TMPDIR=str(node / "tmp"), OMP_NUM_THREADS="1")


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the engine exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"no {path} after {timeout_s}s"
        time.sleep(0.5)
    return json.loads(path.read_text())


def test_two_nodes_share_only_the_run_directory(tiny_model_dir, tmp_path):
    shared, rollout_node, trainer_node = tmp_path / "shared", tmp_path / "node-a", \
        tmp_path / "node-b"
    shutil.copytree(tiny_model_dir, shared / "model")
    write_prompts(make_rows("reverse", num=8, seed=1), shared / "prompts.jsonl")
    ready = shared / "engines" / "node-a.json"
    engine = subprocess.Popen(
        [sys.executable, "-m", "rltool", "serve", "--model", str(shared / "model"),
         "--port", "0", "--ready-file", str(ready), "--allowed-weight-root", str(shared),
         "--allowed-weight-root", str(rollout_node / "local"),
         "--local-checkpoint-dir", str(rollout_node / "local"), "--num-threads", "1"],
        cwd=rollout_node, env=node_env(rollout_node), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "engine.log", "wb"))
    try:
        url = wait_for(ready, engine, timeout_s=180)["url"]
        config = {
            "model": {"path": str(shared / "model")},
            "rollout": {"prompts": str(shared / "prompts.jsonl"), "reward": "reverse:partial",
                        "n_samples_per_prompt": 2, "rollout_batch_size": 2,
                        "max_response_len": 4},
            "train": {"lr": 1e-2, "global_batch_size": 4},
            "sync": {"sync": "delta"},
            "loop": {"num_steps": 1, "placement": "disaggregated", "engine_urls": [url],
                     "engine_local_dir": str(rollout_node / "local"),
                     "trainer_launcher": [sys.executable, "-m", "torch.distributed.run",
                                          "--nnodes=1", "--nproc-per-node=1",
                                          "--rdzv-backend=c10d",
                                          f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m"]},
        }
        (shared / "run.toml").write_text(tomli_w.dumps(config))
        loop = subprocess.run([sys.executable, "-m", "rltool", "loop", "-q", "--json",
                               "--config", str(shared / "run.toml"),
                               "--run-dir", str(shared / "run")],
                              cwd=trainer_node, env=node_env(trainer_node),
                              start_new_session=True, capture_output=True, text=True,
                              timeout=400)
        assert loop.returncode == 0, loop.stderr[-3000:]
        version = json.loads(loop.stdout)["policy_version"]
        served = httpx.get(url + "/get_weight_version", timeout=30).json()["weight_version"]
        assert served == str(version) and version >= 1
    finally:
        os.killpg(engine.pid, signal.SIGTERM)
        engine.wait(timeout=30)
    run = RunDir(shared / "run")
    rows = read_metrics(run.metrics_file("loop"))
    assert [r["step"] for r in rows] == [0] and rows[0]["sync/mode"] == "delta"
    # Each node wrote only to its own directory and the shared one.
    assert (rollout_node / "local" / "model.safetensors").exists()  # rebuilt on the engine's node
    assert not run.local_weights.exists()
    assert sorted(p.name for p in trainer_node.iterdir()) == ["tmp"]
    assert "trainer" not in {e["role"] for e in run.read_engines()}
    assert (run.ckpt_step(version) / "trainer_state.json").exists()
