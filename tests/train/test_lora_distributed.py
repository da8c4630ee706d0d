"""LoRA under DDP and FSDP2 (2 gloo processes under torchrun) matches 1 process on the same
global batch: the frozen base in the same DDP bucket / FSDP unit as the trained adapters, the
KL reference as the adapters switched off, the adapter published and checkpointed unsharded.
Tolerance as tests/train/test_distributed.py states it (1e-5 on the weights after 2 steps)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rltool.train import lora, run
from rltool.train.config import TrainConfig
from tests.helpers.torchrun import train_cli

ARGS = dict(lr=3e-3, max_tokens_per_microbatch=24, global_batch_size=6, num_steps=2,
            micro_batch_layout="padded", lora_rank=4, kl_loss_coef=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one(tiny_model_dir, train_shard, tmp_path, parallel):
    single = run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir),
                             publish=str(tmp_path / "single"), **ARGS))
    want = load_file(tmp_path / "single" / "weight_v000002" / lora.WEIGHTS_FILE)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()]
    proc = train_cli(["--rollouts", str(train_shard), "--load", str(tiny_model_dir),
                      "--save", str(tmp_path / "ckpt"), "--publish", str(tmp_path / "weights"),
                      "--parallel", parallel, "--nproc-per-node", "2", "--json", *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    published = tmp_path / "weights" / "weight_v000002"
    assert sorted(p.name for p in published.iterdir()) == [lora.CONFIG_FILE, lora.WEIGHTS_FILE]
    got = load_file(published / lora.WEIGHTS_FILE)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=0, atol=1e-5), name
    assert any(name.endswith("lora_B.weight") and got[name].abs().max() > 0 for name in got)
    metrics = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    for mine, ref in zip(metrics, single.metrics):
        for name in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm"):
            assert mine[name] == pytest.approx(ref[name], rel=1e-4, abs=1e-7), name
    # Saved unsharded: the 2-rank checkpoint continues in one process.
    more = run(TrainConfig(rollouts=[str(train_shard)], load=str(tmp_path / "ckpt"),
                           **dict(ARGS, num_steps=1)))
    assert more.policy_version == 3 and more.optimizer_steps == 1
