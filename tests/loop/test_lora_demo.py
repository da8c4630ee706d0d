"""The GPU demo's RL phase as LoRA (`--lora-rank`): on the tiny shapes on CPU, the warm start
trains every parameter, the loop trains a rank-R adapter at 10 x --rl-lr on its result and every
sync hands the in-process engine the adapter alone."""

from __future__ import annotations

import json

import pytest

from rltool import demo
from rltool.demo_gpu import GpuRecipe
from rltool.errors import BadInputError
from rltool.rundir import RunDir, read_metrics


@pytest.mark.slow
def test_gpu_recipe_with_lora_runs_on_cpu(tmp_path, capsys):
    root = tmp_path / "demo-run"
    demo.main([str(root), "--task", "add", "--preset", "tiny", "--steps", "2", "--sft-steps",
               "2", "--rollout-batch-size", "4", "--eval-prompts", "8", "--sft-prompts", "64",
               "--lora-rank", "4", "-q"])
    assert "LoRA rank 4 at lr 0.0004" in capsys.readouterr().out
    summary = json.loads((root / "summary.json").read_text())
    assert summary["lora_rank"] == 4 and summary["rl_lr"] == pytest.approx(4e-4)
    run = RunDir(root / "run")
    rows = read_metrics(run.metrics_file("loop"))
    assert [r["sync/mode"] for r in rows] == ["tensor", "tensor"]
    assert len({r["perf/update_weights_wire_bytes"] for r in rows}) == 1
    base = (root / "sft" / "weights" / "weight_v000002" / "model.safetensors").stat().st_size
    assert 0 < rows[0]["perf/update_weights_wire_bytes"] < base / 4
    last = run.weight_version(json.loads((root / "run" / "state.json").read_text())
                              ["policy_version"])
    assert (last / "adapter_config.json").is_file() and not (last / "model.safetensors").exists()
    # the peak of the 2-step warmup
    assert max(r["train/lr"] for r in read_metrics(run.metrics_file("train"))) \
        == pytest.approx(4e-4)


def test_gpu_recipe_lora_refusals():
    with pytest.raises(BadInputError, match="--lora-lr is the LoRA RL rate"):
        GpuRecipe(lora_lr=1e-3)
    with pytest.raises(BadInputError, match="drop --rollout-precision fp8"):
        GpuRecipe(lora_rank=8, rollout_precision="fp8")
    assert GpuRecipe(lora_rank=8).rl_train == {"lr": 4e-4, "lora_rank": 8}
    assert GpuRecipe(lora_rank=8, lora_lr=1e-3).rl_train["lr"] == 1e-3
    assert GpuRecipe().rl_train == {"lr": 4e-5}
