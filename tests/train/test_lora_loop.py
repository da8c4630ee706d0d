"""LoRA in the loop with merged publishing (`[train] lora_rank`, `lora_merge_on_publish`): the
resident trainer checkpoints the adapter alone, the engine is synced with the merged weights (the version written at a checkpoint step is exactly
W + scale * B @ A of the checkpoint's adapter on the base), the KL term against the base is on,
and `loop --resume` continues from the adapter checkpoint."""

from __future__ import annotations

import pytest
import tomli_w
import torch
from safetensors.torch import load_file

from rltool.data.tasks import make_rows, write_prompts
from rltool.rundir import RunDir, read_metrics
from tests.loop.test_loop_live import loop_cli


@pytest.mark.slow
def test_lora_loop_syncs_merged_weights_and_resumes(tiny_model_dir, tmp_path):
    write_prompts(make_rows("reverse", num=8, seed=1), tmp_path / "rl.jsonl")
    config = {
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"prompts": str(tmp_path / "rl.jsonl"), "reward": "reverse:partial",
                    "n_samples_per_prompt": 2, "rollout_batch_size": 2, "max_response_len": 6},
        "train": {"lr": 1e-2, "global_batch_size": 2, "lora_rank": 4, "lora_alpha": 4.0,
                  "kl_loss_coef": 0.01, "entropy_coef": 0.01,  # entropy: a gradient always
                  "lora_merge_on_publish": True},
        "loop": {"num_steps": 3, "seed": 3},
    }
    (tmp_path / "run.toml").write_text(tomli_w.dumps(config))
    run = tmp_path / "run"
    proc = loop_cli("--config", str(tmp_path / "run.toml"), "--run-dir", str(run), "--engine",
                    "inprocess", "--sync", "tensor")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rundir = RunDir(run)
    ckpt = rundir.ckpt_step(6)
    assert (ckpt / "adapter" / "adapter_model.safetensors").exists()
    assert not (ckpt / "model").exists()
    adapter = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    served = load_file(rundir.weight_version(6) / "model.safetensors")
    moved = 0
    for key, w in base.items():
        module = "base_model.model." + key.removesuffix(".weight")
        if module + ".lora_A.weight" in adapter:
            a, b = adapter[module + ".lora_A.weight"], adapter[module + ".lora_B.weight"]
            assert torch.equal(served[key], w + 1.0 * (b @ a)), key  # alpha / rank = 1
            moved += not torch.equal(served[key], w)
        elif key in served:
            assert torch.equal(served[key], w), key
    assert moved > 0
    rows = read_metrics(rundir.metrics_file("train"))
    assert rows[0]["train/kl_loss"] == 0.0 and rows[-1]["train/kl_loss"] > 0.0
    proc = loop_cli("--resume", str(run), "--num-steps", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (rundir.ckpt_step(8) / "adapter").is_dir()
    assert [r["policy_version"] for r in read_metrics(rundir.metrics_file("train"))] == list(
        range(1, 9))
