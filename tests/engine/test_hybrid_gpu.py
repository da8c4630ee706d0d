"""The tiny qwen3_5 hybrid on a CUDA GPU in deterministic mode: the engine's recomputing full pass
(each GDN layer through transformers' own functions, HybridLM._gdn_as_trainer) against the torch
trainer on the same GPU, through the align gate, in fp32 and bf16.

Skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_deterministic import served_rollout_gate
from tests.helpers.hybrid import make_hybrid

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hybrid_align_gate_is_exactly_zero_on_the_gpu(dtype, tmp_path):
    """`rltool serve --device cuda --deterministic` samples a shard of the hybrid through the
    rollout stage; `align-gate --device auto --deterministic` recomputes with the torch trainer
    on the same GPU in the recorded dtype: every token's logprob equal."""
    result = served_rollout_gate(make_hybrid(tmp_path / "m"), dtype, tmp_path,
                                 max_response_len=80,
                                 engine_args=("--disable-radix-cache",))
    assert result.config["device"] == "cuda" and result.config["dtype"] == dtype
    assert result.num_masked_tokens > 0
    assert result.max_abs_diff == 0.0 and result.passed, result.worst_positions
