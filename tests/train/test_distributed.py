"""DDP and FSDP2 with 2 gloo processes under torchrun match 1 process on the same global batch.

Tolerance: after 2 AdamW steps (lr 3e-3) every weight within 1e-5 of the single-process run and
the metrics within 1e-4 relative. The ranks see different micro-batch shapes (padding), so float
sums differ in the last bits, and Adam's normalised update can amplify that to ~1e-6.

The process group a rank started ends with its threads before the interpreter does.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from rltool.train import run
from rltool.train.config import TrainConfig
from rltool.train.launch import process_group_scope
from tests.helpers.torchrun import train_cli

# The padded layout on both sides: `auto` would pick the shared-prompt layout on CPU, whose rows
# depend on which samples share a micro-batch, so one process and two ranks would round
# differently beyond what this test bounds (layouts are compared in test_shared_prompt.py).
ARGS = dict(lr=3e-3, max_tokens_per_microbatch=24, global_batch_size=6, num_steps=2,
            entropy_coef=0.01, micro_batch_layout="padded")


def _single(tiny_model_dir, train_shard, root, estimator, extra):
    result = run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir),
                             publish=str(root / "weights"), advantage_estimator=estimator, **ARGS,
                             **extra))
    return result, load_file(root / "weights" / "weight_v000002" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("parallel,deterministic,estimator", [("ddp", False, "grpo"),
                                                               ("fsdp", True, "ppo")])
def test_two_processes_match_one(tiny_model_dir, tiny_model_factory, train_shard, tmp_path,
                                 parallel, deterministic, estimator):
    """FSDP2 runs PPO (its value head is a separate fully_shard unit) in the deterministic layout
    (per-sample passes padded to the same count on every rank), with a KL reference switched into
    the sharded model as a weight snapshot (each rank loads its own shards of it)."""
    extra = {}
    if parallel == "fsdp":
        extra = dict(ref=str(tiny_model_factory("qwen2", seed=1)), kl_loss_coef=0.1)
    result, want = _single(tiny_model_dir, train_shard, tmp_path / "single", estimator, extra)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**ARGS, **extra}.items()]
    proc = train_cli(["--rollouts", str(train_shard), "--load", str(tiny_model_dir),
                      "--save", str(tmp_path / "ckpt"), "--publish", str(tmp_path / "weights"),
                      "--parallel", parallel, "--nproc-per-node", "2", "--json", *flags,
                      "--advantage-estimator", estimator,
                      "--deterministic" if deterministic else "--no-deterministic"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["policy_version"] == 2
    state = json.loads((tmp_path / "ckpt" / "step-000002" / "trainer_state.json").read_text())
    assert state["backend"]["world_size"] == 2 and state["backend"]["parallel"] == parallel
    got = load_file(tmp_path / "weights" / "weight_v000002" / "model.safetensors")
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=0, atol=1e-5), name
    assert any(not torch.equal(got[n], initial[n]) for n in got)
    metrics = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    for mine, ref in zip(metrics, result.metrics):
        names = ["train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm",
                 "train/ppo_kl"] + (["train/value_loss"] if estimator == "ppo" else []) + (
                     ["train/kl_loss"] if extra else [])
        for name in names:
            assert mine[name] == pytest.approx(ref[name], rel=1e-4, abs=1e-7), name
    # Saved unsharded: the 2-rank checkpoint continues in one process (RNG reseeded, warned).
    more = run(TrainConfig(rollouts=[str(train_shard)], load=str(tmp_path / "ckpt"),
                           advantage_estimator=estimator, **dict(ARGS, num_steps=1)))
    assert more.policy_version == 3 and more.optimizer_steps == 1


def _gloo_threads() -> int:
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    return sum(name in ("pt_gloo_runloop", "gloo_tcp_loop") for name in names)


def _fsdp_step() -> None:
    """One FSDP2 step and a full state dict in a one-process gloo group (DTensor caches its
    DeviceMesh on the way)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.randn(2, 8)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def test_process_group_scope_ends_the_gloo_threads():
    """A process group still referenced after destroy_process_group (FSDP2's mesh in DTensor's
    caches) kept its gloo threads running into interpreter shutdown, where a torchrun rank
    aborted ("terminate called without an active exception"): the scope ends them."""
    gc.collect()  # groups that earlier tests ended but whose last holders await collection
    before = _gloo_threads()
    with process_group_scope():
        _fsdp_step()
        assert _gloo_threads() > before
    assert not dist.is_initialized() and _gloo_threads() == before
