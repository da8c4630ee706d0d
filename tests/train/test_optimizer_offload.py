"""`--optimizer-cpu-offload` and `--param-dtype bf16`: the optimizer's state and step on the host,
master weights held by the optimizer. Each is compared with the plain path on the same fixed
12-sample shard (train_shard): megatron (fp32, one gloo rank) within 1e-6, the torch backend's
fp32 offload bit for bit (the same operations on the same values), bf16 parameters with fp32
masters against fp32 parameters under bf16 autocast within bf16 rounding; and resuming from a
checkpoint of each gives the uninterrupted run's weights bit for bit."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from safetensors.torch import load_file

from rltool.errors import ConfigError
from rltool.train import run
from rltool.train.config import TrainConfig

# eps 1e-6 as in test_megatron.py: Adam's first step turns last-bit gradient differences of
# entries with |g| ~ eps into weight differences of up to lr
ARGS = dict(lr=3e-3, max_tokens_per_microbatch=24, global_batch_size=6, entropy_coef=0.01,
            adam_eps=1e-6)
METRICS = ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm")


def _train(shard, model, save, *, steps=1, **extra):
    return run(TrainConfig(rollouts=[str(shard)], load=str(model), save=str(save),
                           num_steps=steps, save_interval=1, **ARGS, **extra))


def _weights(save, step=1):
    return load_file(save / f"step-{step:06d}" / "model" / "model.safetensors")


def _max_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_megatron_offloaded_step_equals_the_device_step(tiny_model_dir, train_shard, tmp_path):
    """megatron-core's HybridDeviceOptimizer, all of the state on the host: one step equals the
    distributed optimizer's on the device (host AdamW is torch's fused CPU kernel, the device's
    its foreach one: they round differently in the last bits)."""
    common = dict(backend="megatron", use_distributed_optimizer=True)
    plain = _train(train_shard, tiny_model_dir, tmp_path / "plain", **common)
    offloaded = _train(train_shard, tiny_model_dir, tmp_path / "off", optimizer_cpu_offload=True,
                       **common)
    for name in METRICS:
        assert offloaded.metrics[0][name] == pytest.approx(plain.metrics[0][name], abs=1e-6)
    assert _max_diff(_weights(tmp_path / "off"), _weights(tmp_path / "plain")) < 1e-6


@pytest.mark.slow
def test_megatron_partial_offload_trains_and_resumes_bit_identically(tiny_model_dir,
                                                                     train_shard, tmp_path):
    """Half of the state on the host, half on the device: two steps within 1e-6 of the device
    optimizer's, and a resume from step 1 gives step 2 bit for bit (the host Adam's moments,
    master copies and steps come back from the checkpoint)."""
    common = dict(backend="megatron", use_distributed_optimizer=True)
    plain = _train(train_shard, tiny_model_dir, tmp_path / "plain", steps=2, **common)
    half = dict(common, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    straight = _train(train_shard, tiny_model_dir, tmp_path / "a", steps=2, **half)
    assert _max_diff(_weights(tmp_path / "a", 2), _weights(tmp_path / "plain", 2)) < 1e-6
    assert straight.metrics[1]["train/grad_norm"] == pytest.approx(
        plain.metrics[1]["train/grad_norm"], abs=1e-6)
    resumed = _train(train_shard, tmp_path / "a" / "step-000001", tmp_path / "b", steps=2, **half)
    for name in METRICS:
        assert resumed.metrics[0][name] == straight.metrics[1][name], name
    assert _max_diff(_weights(tmp_path / "b", 2), _weights(tmp_path / "a", 2)) == 0.0


def test_torch_offloaded_optimizer_is_the_plain_step_bit_for_bit(tiny_model_dir, train_shard,
                                                                 tmp_path):
    """fp32 parameters, AdamW's moments and fp32 masters on the host: two steps give the plain
    optimizer's weights exactly; a resume from step 1 gives step 2 exactly; the checkpoints
    keep the plain layout (the plain optimizer resumes from an offloaded one's)."""
    plain = _train(train_shard, tiny_model_dir, tmp_path / "plain", steps=2)
    off = _train(train_shard, tiny_model_dir, tmp_path / "off", steps=2,
                 optimizer_cpu_offload=True)
    for step in (0, 1):
        for name in METRICS:
            assert off.metrics[step][name] == plain.metrics[step][name], name
    assert _max_diff(_weights(tmp_path / "off", 2), _weights(tmp_path / "plain", 2)) == 0.0
    _train(train_shard, tmp_path / "off" / "step-000001", tmp_path / "resumed", steps=2,
           optimizer_cpu_offload=True)
    assert _max_diff(_weights(tmp_path / "resumed", 2), _weights(tmp_path / "off", 2)) == 0.0
    _train(train_shard, tmp_path / "off" / "step-000001", tmp_path / "plain-resumed", steps=2)
    assert _max_diff(_weights(tmp_path / "plain-resumed", 2),
                     _weights(tmp_path / "plain", 2)) == 0.0


def test_torch_bf16_parameters_with_fp32_masters(tiny_model_dir, train_shard, tmp_path):
    """bf16 parameters and compute, fp32 main gradients and masters against the bf16 autocast
    path (fp32 parameters): the same losses within bf16 rounding, grad norms within 1%, and
    first-step weights apart only where a gradient's sign flipped;
    the checkpoint holds the fp32 masters, and the offloaded variant is the same bit for bit."""
    autocast = _train(train_shard, tiny_model_dir, tmp_path / "autocast", steps=2, dtype="bf16")
    masters = _train(train_shard, tiny_model_dir, tmp_path / "bf16", steps=2, dtype="bf16",
                     param_dtype="bf16")
    for step in (0, 1):
        assert masters.metrics[step]["train/loss"] == pytest.approx(
            autocast.metrics[step]["train/loss"], abs=2e-3)
        assert masters.metrics[step]["train/grad_norm"] == pytest.approx(
            autocast.metrics[step]["train/grad_norm"], rel=1e-2)
    weights = _weights(tmp_path / "bf16", 2)
    assert {t.dtype for t in weights.values()} == {torch.float32}
    # Adam's first step moves each weight by about lr * sign(g): the two paths part only where a
    # gradient's sign differs, which bf16 rounding flips for few entries
    one, other = _weights(tmp_path / "bf16"), _weights(tmp_path / "autocast")
    assert _max_diff(one, other) <= 2 * ARGS["lr"] + 1e-6
    apart = sum(int(((one[k] - other[k]).abs() > ARGS["lr"] / 2).sum()) for k in one)
    assert apart < 0.05 * sum(t.numel() for t in one.values()), apart
    # fp32 masters: the weights moved by less than bf16's resolution, not just bf16 steps
    start = load_file(tiny_model_dir / "model.safetensors")
    moved = [(weights[k] - start[k]) for k in weights]
    assert any(bool((m != m.bfloat16().float()).any()) for m in moved)
    _train(train_shard, tiny_model_dir, tmp_path / "bf16-off", steps=2, dtype="bf16",
           param_dtype="bf16", optimizer_cpu_offload=True)
    assert _max_diff(_weights(tmp_path / "bf16-off", 2), weights) == 0.0


def test_master_weight_options_are_checked(tiny_model_dir, train_shard):
    base = dict(rollouts=[str(train_shard)], load=str(tiny_model_dir))
    with pytest.raises(ConfigError, match="--param-dtype bf16 computes in bf16: add --dtype bf16"):
        TrainConfig(**base, param_dtype="bf16")
    with pytest.raises(ConfigError, match="needs megatron's distributed optimizer: add "
                                          "--use-distributed-optimizer"):
        TrainConfig(**base, backend="megatron", optimizer_cpu_offload=True)
    with pytest.raises(ConfigError, match="--param-dtype is the torch backend's"):
        TrainConfig(**base, backend="megatron", dtype="bf16", param_dtype="bf16")
    with pytest.raises(ConfigError, match="--optimizer-offload-fraction is a megatron option"):
        TrainConfig(**base, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)


def test_bf16_parameters_release_their_masters_with_the_model():
    """The main-gradient hook lives in each parameter's C++ autograd state, out of the garbage
    collector's sight: holding the optimizer there kept its fp32 masters and moments alive after
    the model was gone (a GPU leak of a whole model's masters per trainer)."""
    from rltool.train.master_weights import MasterWeights

    model = torch.nn.Linear(8, 8)
    opt = MasterWeights(list(model.named_parameters()), lambda ms: torch.optim.AdamW(ms),
                        param_dtype=torch.bfloat16, host=False)
    model(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
    opt.clip_grad_norm(1.0, foreach=None)
    opt.step()
    held = [weakref.ref(opt), weakref.ref(opt.masters[0]), weakref.ref(model.weight)]
    del model, opt
    gc.collect()
    assert [ref() for ref in held] == [None, None, None]
