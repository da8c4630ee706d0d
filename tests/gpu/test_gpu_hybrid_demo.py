"""The GPU demo on the hybrid (`python -m rltool.demo --device cuda --arch qwen3_5`), shortened
and on the 4-layer tiny hybrid (the kernels at the recipe's hybrid-0.7b sizes are
tests/engine/test_hybrid_gpu.py's): a 5-step bf16 warm start, two RL steps of 16 prompts x 8
samples colocated with the in-process engine (Triton Gated DeltaNet kernels, fp32 recurrent
states, eager decode) and the tensor sync between them.

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import json

import pytest
import torch

from rltool import demo
from rltool.rundir import read_metrics

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.timeout(300)
def test_hybrid_demo_runs_on_the_gpu(tmp_path, capsys):
    root, out = tmp_path / "demo-run", tmp_path / "summary.json"
    demo.main([str(root), "--device", "cuda", "--arch", "qwen3_5", "--preset", "tiny-4l",
               "--steps", "2", "--sft-steps", "5", "--sft-prompts", "512",
               "--rollout-batch-size", "16", "--eval-prompts", "32", "--out-json", str(out), "-q"])
    assert "rltool init-model --arch qwen3_5 --preset tiny-4l" in capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert (summary["device"], summary["arch"], summary["preset"]) == (
        "cuda", "qwen3_5", "tiny-4l")
    assert summary["mamba_ssm_dtype"] == "fp32" and summary["rl_steps"] == 2
    assert summary["final_eval_reward"] is not None
    rows = read_metrics(root / "run" / "metrics" / "loop.jsonl")
    assert [r["sync/mode"] for r in rows] == ["tensor", "tensor"]
    # the engine's kernels against the trainer's torch path, both bf16, on the same weights
    assert 0 < summary["mismatch_means"]["train/train_rollout_logprob_abs_diff"] < 0.1
