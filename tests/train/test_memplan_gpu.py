"""The training memory plans against the measured peak on one GPU, Qwen2.5-3B shapes (random init,
bf16): `--recompute auto` and the automatic micro-batch cap choose a setting for this device
(rltool.train.memfit), the trainer runs two optimizer steps on micro-batches of that many tokens,
and `torch.cuda.max_memory_allocated` over the second step is within MARGIN of the plan.

Cases: megatron with the plan's choice (an 80 GB H100: full recompute), megatron with a quarter
of the optimizer on the host (the host's Adam steps take most of this test's time; a quarter's
fp32 masters and moments, ~8.6 GiB, are still more than twice the margin of a plan that forgot
them), and the torch backend with bf16 parameters and fp32 masters. Skipped without CUDA; the
rest of the time goes to writing and reading the weights."""

from __future__ import annotations

import json

import pytest
import torch

from rltool.train import memfit, memplan
from rltool.train import megatron_memplan as mplan
from rltool.train.config import TrainConfig
from tests.helpers.train_peak import measured_step_peak

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GIB = float(1 << 30)
MARGIN = 0.05


def _predicted(cfg: TrainConfig, hf: dict) -> int:
    if cfg.backend == "megatron":
        fraction = cfg.optimizer_offload_fraction if cfg.optimizer_cpu_offload else 0.0
        return mplan.plan(mplan.ModelShape.of(hf), mplan.Layout.of(cfg, world_size=1),
                          dtype=cfg.dtype, recompute=cfg.recompute,
                          micro_batch_tokens=cfg.max_tokens_per_microbatch,
                          logprob_chunk_tokens=cfg.logprob_chunk_tokens,
                          offload_fraction=fraction).device_bytes
    return memfit.predictor(cfg, hf, world_size=1)(cfg.recompute, cfg.max_tokens_per_microbatch)


@pytest.mark.parametrize("extra", [
    dict(backend="megatron", use_distributed_optimizer=True),
    dict(backend="megatron", use_distributed_optimizer=True, optimizer_cpu_offload=True,
         optimizer_offload_fraction=0.25),
    dict(backend="torch", param_dtype="bf16"),
], ids=["megatron", "megatron-offload", "torch-bf16-masters"])
def test_the_plan_is_the_measured_peak(model_3b, extra):
    cfg = TrainConfig(rollouts=["unused"], load=str(model_3b), dtype="bf16", device="cuda",
                      lr=1e-6, recompute="auto", max_tokens_per_microbatch=0, **extra)
    cfg = cfg.model_copy(update=memfit.fit(cfg, model_3b, longest=1))
    hf = json.loads((model_3b / "config.json").read_text())
    tokens = cfg.max_tokens_per_microbatch
    predicted = _predicted(cfg, hf)
    assert predicted <= memfit.room(torch.cuda.get_device_properties(0).total_memory)
    peak = measured_step_peak(model_3b, cfg)
    print(f"{extra}: recompute {cfg.recompute}, {tokens} tokens: measured {peak / GIB:.2f} GiB, "
          f"planned {predicted / GIB:.2f} GiB ({(peak - predicted) / predicted:+.1%}); device "
          f"{torch.cuda.get_device_properties(0).total_memory / GIB:.1f} GiB, room "
          f"{memfit.room(torch.cuda.get_device_properties(0).total_memory) / GIB:.1f} GiB, "
          f"reserve {memplan.DEVICE_RESERVE / GIB:.0f} GiB + {memfit.FRAGMENTATION:.0%}")
    assert abs(peak - predicted) <= MARGIN * predicted, (peak / GIB, predicted / GIB)
