"""The agentic demo and the multi-turn throughput benchmark on one GPU, at smoke size: the demo's
cuda path (bf16 warm start from the demonstrations shard, colocated loop with the engine's
decode graphs sized for the step's episodes) runs two RL steps of calculator episodes, and the
benchmark's cuda engine produces both variants' exact token budgets.

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import rollout_multiturn
from rltool import demo_agentic

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.timeout(600)
def test_demo_runs_on_the_gpu(tmp_path, capsys):
    out = tmp_path / "summary.json"
    demo_agentic.main([str(tmp_path / "run"), "--device", "cuda", "--preset", "tiny",
                       "--steps", "2", "--sft-steps", "20", "--call-rate", "1",
                       "--rollout-batch-size", "4", "--eval-prompts", "8", "--sft-prompts",
                       "256", "--out-json", str(out), "-q"])
    summary = json.loads(out.read_text())
    assert summary["device"] == "cuda" and [r["step"] for r in summary["steps"]] == [0, 1]
    assert summary["final_eval_exact"] is not None
    assert "calls" in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_benchmark_quick_on_the_gpu(tmp_path, capsys):
    out = tmp_path / "record.json"
    rollout_multiturn.main(["--device", "cuda", "--quick", "--out", str(out)])
    record = json.loads(out.read_text())
    _, prompts, samples, turns, tokens, _ = rollout_multiturn.WORKLOADS["quick"]
    assert record["machine"]["gpu"]
    assert (record["tokens"]["single-turn"]["model_tokens"]
            == record["tokens"]["multi-turn"]["model_tokens"] == prompts * samples * turns * tokens)
    assert record["multi_over_single"] > 0
