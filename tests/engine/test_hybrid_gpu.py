"""The tiny qwen3_5 hybrid on a CUDA GPU in deterministic mode: the engine's recomputing full pass
(each GDN layer through transformers' own functions, HybridLM._gdn_as_trainer) against the torch
trainer on the same GPU, through the align gate, in fp32 and bf16.

Skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.hybrid import make_hybrid

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hybrid_align_gate_is_exactly_zero_on_the_gpu(dtype, tmp_path):
    """`rltool serve --device cuda --deterministic` samples a shard of the hybrid through the
    rollout stage; `align-gate --device auto --deterministic` recomputes with the torch trainer
    on the same GPU in the recorded dtype: every token's logprob equal."""
    from rltool.align.config import AlignGateConfig
    from rltool.align.gate import run as gate
    from rltool.data.tasks import make_rows, write_prompts
    from rltool.rollout.launch import start_engine
    from rltool.rollout.stage import RolloutConfig, run as rollout

    model_dir = make_hybrid(tmp_path / "m")
    proc = start_engine(["--engine", "builtin", "--model", str(model_dir), "--device", "cuda",
                         "--dtype", dtype, "--deterministic", "--disable-radix-cache"],
                        log_path=tmp_path / "engine.log", ready_timeout_s=300.0)
    try:
        prompts = write_prompts(make_rows("reverse", num=4, seed=3), tmp_path / "prompts.jsonl")
        out = tmp_path / "rollouts" / "step-000000"
        rollout(RolloutConfig(engines=[proc.url], prompts=str(prompts), out=str(out),
                              n_samples_per_prompt=4, max_response_len=80, reward="reverse",
                              rollout_batch_size=4, seed=7, temperature=1.0, quiet=True))
    finally:
        proc.stop()
    result = gate(AlignGateConfig(rollouts=[str(out)], weights=str(model_dir), tol=0.0,
                                  deterministic=True, device="auto"))
    assert result.config["device"] == "cuda" and result.config["dtype"] == dtype
    assert result.num_masked_tokens > 0
    assert result.max_abs_diff == 0.0 and result.passed, result.worst_positions
