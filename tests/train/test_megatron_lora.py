"""LoRA on `--backend megatron` (rltool.train.megatron_lora), fp32 on the CPU with gloo.

One run per layout (tests/train/megatron_lora_ranks.py): TP1 in this process, TP2 with the
distributed optimizer and PP2 as 2 torchrun ranks each; each takes two steps with a checkpoint
after the first and resumes it. Checked: the two-rank layouts' adapters equal TP1's exactly at
init and within 1e-5 after each step (Adam's sign-like first steps turn fp32 rounding of
different GEMM shapes into ~1e-6, see test_megatron.py), with the same grad norms; only the
adapters are trainable and buffered and the base does not move; every adapter key of a
two-rank save comes back bit for bit and the resumed step is the uninterrupted one; the forward equals PEFT's PeftModel over the same base and
adapter within 1e-5, and with the adapters off the base model's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rltool.errors import CheckpointError, ConfigError
from rltool.train import lora, megatron_lora, run
from rltool.train.config import BackendConfig, TrainConfig
from tests.helpers.shards import REWARDS, make_shard, shard_rows
from tests.train.megatron_lora_ranks import BATCH, LORA, run_layout

LAYOUTS = {"tp1": {}, "tp2": {"tensor_model_parallel_size": 2, "use_distributed_optimizer": True},
           "pp2": {"pipeline_model_parallel_size": 2}}
STEPS = ("init", "step1", "step2", "loaded", "resumed", "reloaded")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    """layout -> (record.json, {step: adapter tensors}, checkpoint dir)."""
    return {name: run_ranks(model, tmp_path_factory.mktemp(name), layout,
                            nproc=layout.get("tensor_model_parallel_size", 1)
                            * layout.get("pipeline_model_parallel_size", 1))
            for name, layout in LAYOUTS.items()}


def run_ranks(model: Path, root: Path, layout: dict, *, nproc: int):
    """megatron_lora_ranks.run_layout in this process (nproc 1) or under torchrun."""
    if nproc == 1:
        run_layout(model, root, layout)
    else:
        repo = Path(__file__).resolve().parents[2]
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={nproc}", str(repo / "tests" / "train" / "megatron_lora_ranks.py"),
             str(model), str(root), json.dumps(layout)], capture_output=True, text=True,
            timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo)))
        assert proc.returncode == 0, proc.stderr[-3000:]
    return (json.loads((root / "record.json").read_text()),
            {step: load_file(root / f"{step}.safetensors") for step in STEPS}, root / "ckpt")


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_two_rank_adapter_equals_tp1(runs, layout):
    tp1 = runs["tp1"][1]["init"]
    assert tp1.keys() == {f"model.layers.{layer}.{parent}.{name}.lora_{kind}.weight"
                          for layer in range(2) for name, parent in megatron_lora.HF_PARENT.items()
                          for kind in "AB"}
    assert tp1["model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert tp1["model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    assert_same_training(runs["tp1"], runs[layout], atol=1e-5)


def assert_same_training(one, other, *, atol: float) -> None:
    """The same adapter keys, equal adapters at init, within `atol` after each step, grad norms
    within `atol`."""
    (record1, tp1, _), (record2, tp2, _) = one, other
    want = tp1["init"].keys()
    for step in ("init", "step1", "step2"):
        assert tp1[step].keys() == tp2[step].keys() == want, step
    assert all(torch.equal(tp1["init"][k], tp2["init"][k]) for k in want)
    for step in ("step1", "step2"):
        for k in want:
            assert torch.allclose(tp1[step][k], tp2[step][k], rtol=0, atol=atol), (step, k)
    for m1, m2 in zip(record1["metrics"], record2["metrics"], strict=True):
        assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=0, abs=atol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_the_adapters_train(runs, layout):
    assert_only_adapters_train(runs[layout])


def assert_only_adapters_train(run) -> None:
    record, steps, _ = run
    for rank in record["ranks"]:
        assert rank["trainable"] and all(".lora_" in n for n in rank["trainable"])
        assert rank["trainable"] == rank["buffered"]
        assert rank["adapter_dtypes"] == ["torch.float32"]
    # every adapter tensor (A and B of each module) on every TP rank, over the pipeline stages
    adapters = sum(len(rank["trainable"]) for rank in record["ranks"])
    assert adapters == len(steps["init"]) * len(record["ranks"]) // record["pp"]
    assert record["base_unchanged"]
    for k, init in steps["init"].items():
        assert not torch.equal(steps["step2"][k], init), k  # every adapter tensor moved
        if k.endswith("lora_B.weight"):
            assert not init.any(), k


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_keeps_every_adapter_shard_and_resumes_bit_identically(runs, layout):
    assert_checkpoint_round_trip(runs[layout])


def assert_checkpoint_round_trip(run) -> None:
    record, steps, ckpt = run
    for k, tensor in steps["step1"].items():
        assert torch.equal(steps["loaded"][k], tensor), k
        assert torch.equal(steps["resumed"][k], steps["step2"][k]), k
        assert torch.equal(steps["reloaded"][k], tensor), k  # load_adapter of adapter/
    assert steps["loaded"].keys() == steps["reloaded"].keys() == steps["step1"].keys()
    config, on_disk = lora.read_adapter(ckpt / "adapter")
    assert on_disk.keys() == steps["step1"].keys()
    assert all(torch.equal(on_disk[k], steps["step1"][k]) for k in on_disk)
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == sorted({k.split(".")[-3] for k in on_disk})
    assert not (ckpt / "model").exists()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["backend"]["lora"]["rank"] == 4
    assert record["resumed_metrics"] == record["metrics"][1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_equals_peft(runs, model, tmp_path, layout):
    assert_forward_equals_peft(runs[layout], model, tmp_path, atol=1e-5)


def assert_forward_equals_peft(run, model: Path, tmp_path: Path, *, atol: float) -> None:
    """The logprobs after step 2 equal PeftModel's (fp32, CPU) over the same base and adapter
    within `atol`, and the base model's with the adapters off."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    record, steps, _ = run
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
              "lora_dropout": 0.0,
              "target_modules": sorted({k.split(".")[-3] for k in steps["step2"]}),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "base_model_name_or_path": str(model)}
    lora.write_adapter(tmp_path, tensors=steps["step2"], config=config)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), str(tmp_path)).eval()
    moved = 0.0
    for i, (tokens, start) in enumerate(zip(BATCH.tokens, BATCH.response_starts, strict=True)):
        ids = torch.tensor([tokens])
        with torch.no_grad():
            on = torch.log_softmax(peft(input_ids=ids).logits[0, start - 1:-1], -1)
            with peft.disable_adapter():
                off = torch.log_softmax(peft(input_ids=ids).logits[0, start - 1:-1], -1)
        target = ids[0, start:, None]
        for ref, mine in ((on, record["logprobs_on"][i]), (off, record["logprobs_off"][i])):
            assert torch.allclose(ref.gather(-1, target)[:, 0], torch.tensor(mine), rtol=0,
                                  atol=atol)
        moved = max(moved, (on - off).abs().max().item())
    assert moved > 1e-3  # the adapter changes the forward: the comparison is not the base's


@pytest.mark.parametrize("update,match", [
    (dict(sequence_parallel=True), "without --sequence-parallel"),
    (dict(lora_target_modules=["q_proj", "lm_head"]), "--lora-target-modules lm_head"),
])
def test_refusals_name_the_flag(model, update, match):
    options = BackendConfig(backend="megatron", **LORA, **update)
    with pytest.raises(ConfigError, match=match):
        megatron_lora.check_layout(options, json.loads((model / "config.json").read_text()))


def test_moe_experts_are_refused(tiny_model_factory):
    moe = tiny_model_factory("qwen3_moe")
    options = BackendConfig(backend="megatron", **LORA)  # the default targets: MLP ones too
    with pytest.raises(ConfigError, match="gate_proj,up_proj,down_proj: --backend megatron does "
                                          "not adapt MoE experts"):
        megatron_lora.check_layout(options, json.loads((moe / "config.json").read_text()))


@pytest.fixture(scope="module")
def moe_tp1(tiny_model_factory, tmp_path_factory):
    """qwen3_moe (q/k norms, routed experts) with attention-only adapters: (model, TP1 run)."""
    moe = tiny_model_factory("qwen3_moe")
    return moe, run_ranks(moe, tmp_path_factory.mktemp("moe-tp1"),
                          {"lora_target_modules": list(ATTENTION)}, nproc=1)


def test_moe_attention_adapters_equal_peft(moe_tp1, tmp_path):
    moe, run = moe_tp1
    assert {k.split(".")[-3] for k in run[1]["init"]} == set(ATTENTION)
    assert_only_adapters_train(run)
    assert_checkpoint_round_trip(run)
    assert_forward_equals_peft(run, moe, tmp_path, atol=1e-5)


@pytest.mark.slow
def test_moe_attention_adapters_under_ep2_equal_tp1(moe_tp1, tmp_path):
    """EP2: two data-parallel ranks for the attention (each its half of the loss), one expert
    each."""
    moe, tp1 = moe_tp1
    ep2 = run_ranks(moe, tmp_path, {"expert_model_parallel_size": 2,
                                    "lora_target_modules": list(ATTENTION)}, nproc=2)
    assert_same_training(tp1, ep2, atol=1e-5)
    assert_only_adapters_train(ep2)
    assert_checkpoint_round_trip(ep2)


def test_all_linear_is_every_adaptable_module():
    assert megatron_lora.resolve_targets([lora.ALL_LINEAR]) == list(megatron_lora.HF_PARENT)


def test_train_publishes_the_adapter_resumes_and_merges(model, tmp_path):
    """`rltool train --backend megatron --lora-rank 4` (KL to the base with the adapters off):
    the published version is exactly the PEFT adapter; resuming the step-1 checkpoint publishes
    the same step-2 adapter bit for bit; --load of that version trains on from its adapter; --lora-merge-on-publish publishes the base weights with
    W + scale * B @ A (checked in float64 against the step-1 checkpoint's adapter)."""
    shard = make_shard(tmp_path / "rollouts" / "step-000001", model, shard_rows(REWARDS),
                       temperature=0.8)
    cfg = dict(rollouts=[str(shard)], backend="megatron", lr=3e-3, max_tokens_per_microbatch=24,
               global_batch_size=6, num_steps=2, kl_loss_coef=0.01, adam_eps=1e-6, **LORA)
    straight = run(TrainConfig(load=str(model), save=str(tmp_path / "a"), save_interval=1,
                               publish=str(tmp_path / "pub-a"), **cfg))
    version = Path(straight.published)
    assert sorted(p.name for p in version.iterdir()) == [lora.CONFIG_FILE, lora.WEIGHTS_FILE]
    resumed = run(TrainConfig(load=str(tmp_path / "a" / "step-000001"), save=str(tmp_path / "b"),
                              publish=str(tmp_path / "pub-b"), **cfg))
    assert resumed.optimizer_steps == 1
    losses = {k: v for k, v in straight.metrics[1].items() if k.startswith("train/")}
    assert losses and all(resumed.metrics[0][k] == v for k, v in losses.items())
    a, b = lora.read_adapter(version)[1], lora.read_adapter(Path(resumed.published))[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # --load of a published adapter version trains on from it
    further = run(TrainConfig(load=str(version), publish=str(tmp_path / "pub-c"),
                              **{**cfg, "num_steps": 1}))
    c = lora.read_adapter(Path(further.published))[1]
    assert c.keys() == a.keys() and further.policy_version == straight.policy_version + 1
    assert all(not torch.equal(c[k], a[k]) for k in a if k.endswith("lora_B.weight"))

    merged = run(TrainConfig(load=str(model), publish=str(tmp_path / "pub-m"),
                             lora_merge_on_publish=True, **{**cfg, "num_steps": 1}))
    weights = load_file(Path(merged.published) / "model.safetensors")
    base = load_file(model / "model.safetensors")
    adapter = lora.read_adapter(tmp_path / "a" / "step-000001" / "adapter")[1]
    assert weights.keys() == base.keys()
    for name, w in base.items():
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in adapter:
            a_, b_ = (adapter[f"{module}.lora_{k}.weight"].double() for k in "AB")
            want = w.double() + 2.0 * b_ @ a_
            assert torch.allclose(weights[name].double(), want, rtol=0, atol=1e-6), name
            assert not torch.equal(weights[name], w), name
        else:
            assert torch.equal(weights[name], w), name


def test_cli_refuses_an_unsupported_layout_in_one_line(model, tmp_path):
    from click.testing import CliRunner

    from rltool.cli import main

    shard = make_shard(tmp_path / "rollouts" / "step-000001", model, shard_rows(REWARDS),
                       temperature=0.8)
    result = CliRunner().invoke(main, [
        "train", "--rollouts", str(shard), "--load", str(model), "--save", str(tmp_path / "ckpt"),
        "--backend", "megatron", "--lora-rank", "4", "--lora-target-modules", "q_proj,lm_head"])
    assert result.exit_code == 2, result.output
    assert "--lora-target-modules lm_head" in result.output
    assert not (tmp_path / "ckpt").exists()


def test_dropout_acts_in_training_only(model):
    """--lora-dropout on a column-parallel (default generator) and a row-parallel (megatron's
    model-parallel RNG tracker) input: two training forwards differ, eval forwards are equal,
    and a train step runs."""
    from rltool.train.launch import process_group_scope
    from rltool.train.megatron_backend import MegatronBackend
    from tests.train.megatron_lora_ranks import loss_fn

    options = BackendConfig(backend="megatron", device="cpu", lora_dropout=0.5, **LORA)
    with process_group_scope():
        backend = MegatronBackend(model, options=options)
        attention = backend.module.decoder.layers[0].self_attention
        with torch.no_grad():
            for linear in (attention.linear_qkv, attention.linear_proj):
                for b in linear.lora_B.values():
                    b.fill_(0.1)
        for linear, width in ((attention.linear_qkv, 64), (attention.linear_proj, 64)):
            x = torch.randn(5, 1, width)
            linear.train()
            assert not torch.equal(linear(x)[0], linear(x)[0])
            linear.eval()
            assert torch.equal(linear(x)[0], linear(x)[0])
        metrics = backend.train_step([BATCH], loss_fn, temperature=1.0)
        assert math.isfinite(metrics["train/grad_norm"])


def test_other_adapters_are_refused_in_one_line(runs, model, tmp_path):
    """A rank-8 trainer refuses the rank-4 checkpoint (resume) and its adapter/ (load_adapter),
    naming the flags that match them, and an adapter whose config matches but whose tensors do
    not, naming the first tensor that differs."""
    from rltool.train.launch import process_group_scope
    from rltool.train.megatron_backend import MegatronBackend

    ckpt = runs["tp1"][2]
    config, tensors = lora.read_adapter(ckpt / "adapter")
    lora.write_adapter(tmp_path / "short", config={**config, "r": 8, "lora_alpha": 8.0},
                       tensors=tensors)
    options = BackendConfig(backend="megatron", **{**LORA, "lora_rank": 8})
    with process_group_scope():
        backend = MegatronBackend(model, options=options)
        other = "a LoRA adapter with r 4.*--lora-rank 4 --lora-alpha 8"
        with pytest.raises(CheckpointError, match=other):
            backend.load(ckpt)
        with pytest.raises(CheckpointError, match=other):
            backend.load_adapter(ckpt / "adapter")
        with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj.lora_A.weight "
                                                  "differs or is missing"):
            backend.load_adapter(tmp_path / "short")