"""The colocated loop on one GPU (`[loop] device = "cuda"`): engine and resident trainer take turns
on the device, so memory falls while the trainer trains and returns for the rollout; after a
tensor sync the engine serves the trainer's weights bit for bit; a 3-step loop with a served
engine runs its tensor syncs over CUDA IPC.

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import pytest
import torch

from rltool.data.tasks import make_rows, write_prompts
from rltool.loop import phases, runner
from rltool.loop.config import LoopSettings
from rltool.loop.engines import ChildRegistry
from rltool.loop.state import LoopState
from rltool.rundir import MetricsWriter, RunDir, read_metrics

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# The engine's share of the device: its KV pool is sized from it, so the fall is easy to see.
ENGINE_ARGS = ["--mem-fraction-static", "0.3", "--max-running-requests", "32"]
GIB = float(1 << 30)


def tables(model_dir, root, *, engine: str) -> dict:
    write_prompts(make_rows("reverse", num=16, seed=1), root / "rl.jsonl")
    write_prompts(make_rows("reverse", num=4, seed=2), root / "eval.jsonl")
    return {"model": {"path": str(model_dir)},
            "rollout": {"prompts": str(root / "rl.jsonl"), "reward": "reverse:partial",
                        "n_samples_per_prompt": 4, "rollout_batch_size": 4,
                        "max_response_len": 8},
            "train": {"lr": 1e-3, "global_batch_size": 16},
            "sync": {"sync": "tensor"},
            "eval": {"prompts": str(root / "eval.jsonl"), "n_samples_per_prompt": 2},
            "loop": {"num_steps": 3, "device": "cuda", "engine": engine, "eval_interval": 2,
                     "engine_args": ENGINE_ARGS}}


def engine_equals_trainer(engine_runner, trainer) -> None:
    targets = engine_runner.model._targets()
    for name, t in trainer.named_tensors():
        if name == "lm_head.weight" and engine_runner.spec.tie_word_embeddings:
            continue
        dest, start, rows = targets[name]
        assert torch.equal(dest[start:start + rows].cpu(), t.detach().cpu().to(dest.dtype)), name


def test_inprocess_loop_alternates_and_the_engine_serves_the_trainer(tiny_model_dir, tmp_path):
    settings = LoopSettings.from_tables(tables(tiny_model_dir, tmp_path, engine="inprocess"))
    run = RunDir(tmp_path / "run").create()
    runner._initial_weights(run, settings)
    registry = ChildRegistry(run)
    engines = runner._engines(run, registry, settings)
    ctx = phases.StepContext(run=run, settings=settings, engines=engines, registry=registry,
                             state=LoopState(num_steps=3))
    assert ctx.residency.alternate
    engines.start(run.weight_version(0))
    try:
        with MetricsWriter(run.metrics_file("loop")) as writer:
            rows = []
            for _ in range(3):
                rows.append(runner.run_step(ctx, writer=writer))
                engine_equals_trainer(engines.engine.runner, ctx.trainer)
                assert ctx.trainer.offloaded and not ctx.residency.engines_released
    finally:
        engines.stop()
    for row in rows:
        used = {p: row[f"memory/{p}_device_used_gib"] for p in ("rollout", "train", "sync")}
        print(row["step"], {k: round(v, 2) for k, v in used.items()},
              {k: round(v, 3) for k, v in row.items() if k.startswith("perf/loop/")})
        assert used["train"] < used["rollout"] - 5, used  # the engine's pool is gone
        assert used["sync"] > used["train"] + 5, used  # and back for the weight update
        assert row["perf/loop/trainer_offload_time"] > 0
        assert row["perf/loop/engine_resume_time"] > 0
    assert rows[-1]["policy_version"] == ctx.state.policy_version


def test_three_step_loop_with_a_served_engine_over_cuda_ipc(tiny_model_dir, tmp_path):
    settings = LoopSettings.from_tables(tables(tiny_model_dir, tmp_path, engine="serve"))
    assert settings.engine_args()[-4:] == ["--device", "cuda", "--dtype", "bf16"]
    result = runner.start(settings, tmp_path / "run")
    assert result["steps"] == 3
    rows = read_metrics(tmp_path / "run" / "metrics" / "loop.jsonl")
    for row in rows:
        assert row["sync/mode"] == "tensor" and row["perf/loop/sync_time"] > 0
        # The served engine released its pool while the trainer trained.
        assert row["memory/train_device_used_gib"] < row["memory/rollout_device_used_gib"] - 5
        print(row["step"], {k: round(v, 3) for k, v in row.items()
                            if k.startswith(("memory/", "perf/loop/"))})
    assert "eval/mean_reward" in rows[-1]
