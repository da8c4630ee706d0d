"""The training memory plans (rltool.train.megatron_memplan, rltool.train.memfit): their state bytes
against the real tensors of megatron and torch trainers built on the CPU, `--recompute auto` and
the automatic micro-batch cap for given device budgets, and the refusal before any model is
built."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from rltool.cli import main
from rltool.data.models import PRESETS
from rltool.errors import ConfigError
from rltool.train import megatron_memplan as mplan
from rltool.train import memfit
from rltool.train.backend import MicroBatch
from rltool.train.config import BackendConfig, TrainConfig
from rltool.train.launch import process_group_scope
from rltool.train.memplan import GIB

H100 = 85_029_158_912  # torch.cuda.get_device_properties(0).total_memory of an H100 80GB HBM3
H200 = 150_754_820_096
MB = MicroBatch([0, 1], [[5, 6, 7, 8, 9, 10], [4, 3, 2, 1]], [2, 1])


def loss_fn(out, mb):
    return sum(lp.sum() for lp in out.logprobs) / 7, {}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _megatron_bytes(backend) -> dict[str, int]:
    """Bytes of the real tensors: frozen parameters, trained parameters (their buffer with the
    distributed optimizer), fp32 gradient buffers, Adam moments on the device side and
    everything the hybrid optimizer holds on the host side (host copies, their gradients, their
    moments)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    ddp = backend.model
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    dist_opt = backend.options.use_distributed_optimizer
    params = list(backend.module.parameters())
    trained = _nbytes(b.param_data for b in buffers) if dist_opt else \
        _nbytes(p for p in params if p.requires_grad)
    out = {"weights": _nbytes(p for p in params if not p.requires_grad) + trained,
           "grads": _nbytes(b.grad_data for b in buffers), "optimizer": 0, "host": 0}
    for part in backend.optimizer.chained_optimizers:
        inner = part.optimizer
        subs = ([(inner.gpu_optimizer, "optimizer")] if inner.gpu_optimizer else []) + [
            (sub, "host") for sub in inner.cpu_optimizers] \
            if isinstance(inner, HybridDeviceOptimizer) else [(inner, "optimizer")]
        for sub, side in subs:
            for state in sub.state.values():
                out[side] += _nbytes(state[k] for k in ("exp_avg", "exp_avg_sq"))
        if isinstance(inner, HybridDeviceOptimizer):
            copies = list(inner.cpu_copys_map_gpu_param)
            out["host"] += _nbytes(copies) + _nbytes(c.grad for c in copies)
    return out


@pytest.mark.parametrize("arch,preset,extra", [
    ("qwen2", "tiny", {}),
    ("qwen2", "tiny", dict(use_distributed_optimizer=True)),
    ("qwen2", "small", dict(use_distributed_optimizer=True)),
    ("qwen2", "tiny", dict(use_distributed_optimizer=True, optimizer_cpu_offload=True)),
    ("qwen3_moe", "tiny", dict(use_distributed_optimizer=True)),
], ids=["tiny", "tiny-distopt", "small-distopt", "tiny-offload", "moe-distopt"])
def test_megatron_state_bytes_are_the_real_tensors(models, arch, preset, extra):
    from rltool.train.megatron_backend import MegatronBackend

    model = models(arch, preset)
    options = BackendConfig(backend="megatron", device="cpu", **extra)
    with process_group_scope():
        backend = MegatronBackend(model, options=options)
        backend.train_step([MB], loss_fn, temperature=1.0)  # Adam's state exists after a step
        real = _megatron_bytes(backend)
    shape = mplan.ModelShape.of(json.loads((model / "config.json").read_text()))
    device, host = mplan.state_bytes(shape, mplan.Layout.of(options, world_size=1), dtype="fp32",
                                     offload_fraction=1.0 if options.optimizer_cpu_offload else 0)
    assert device["weights"] == real["weights"] and device["grads"] == real["grads"]
    assert device.get("optimizer", 0) == real["optimizer"]
    assert host.get("optimizer", 0) == real["host"]
    assert "master_weights" not in device  # fp32 steps the parameters themselves


def test_megatron_buffer_padding_and_shards():
    # with the distributed optimizer each parameter starts at a multiple of 64 (built in
    # reverse order) and the buffer ends at a multiple of lcm(DP, 128)
    assert mplan.buffer_numel([10, 100, 64], dp=1, distributed_optimizer=False) == 174
    assert mplan.buffer_numel([10, 100, 64], dp=1, distributed_optimizer=True) == 256
    assert mplan.buffer_numel([10, 100, 64], dp=3, distributed_optimizer=True) == 384
    shape = mplan.ModelShape.of(dict(PRESETS["qwen2.5-3b"], model_type="qwen2"))
    one = mplan.state_bytes(shape, mplan.Layout(), dtype="bf16")[0]
    tp2 = mplan.state_bytes(shape, mplan.Layout(tp=2), dtype="bf16")[0]
    dp4 = mplan.state_bytes(shape, mplan.Layout(dp=4, distributed_optimizer=True),
                            dtype="bf16")[0]
    n = one["weights"] // 2
    assert one == {"weights": 2 * n, "grads": 4 * n, "master_weights": 4 * n,
                   "optimizer": 8 * n}
    # TP shards all but the norms; each shard of the two vocabulary tables is padded to 128 rows
    norms, h, vocab = 36 * 2 * 2048 + 2048, 2048, 151936
    assert tp2["weights"] // 2 == (n - norms - 2 * vocab * h) // 2 + norms + 2 * 76032 * h
    # the distributed optimizer divides the masters and moments (not weights, grads) over DP
    assert dp4["grads"] >= one["grads"] and dp4["optimizer"] == pytest.approx(2 * n, rel=1e-4)
    assert dp4["master_weights"] == pytest.approx(n, rel=1e-4)


def test_torch_state_bytes_are_the_real_tensors(models):
    from rltool.train.torch_backend import TorchBackend

    for preset in ("tiny", "small"):
        model = models("qwen2", preset)
        for extra in ({}, dict(dtype="bf16", param_dtype="bf16"),
                      dict(optimizer_cpu_offload=True)):
            options = BackendConfig(device="cpu", **extra)
            backend = TorchBackend(model, options=options)
            backend.train_step([MB], loss_fn, temperature=1.0)
            params = list(backend.inner.parameters())
            n = sum(p.numel() for p in params)
            device, host = memfit.torch_state(n, options)
            assert device["params"] == _nbytes(params)
            ids = torch.tensor([[5, 6, 7, 8]])
            backend.inner(input_ids=ids).logits.float().sum().backward()
            opt = backend.optimizer
            grads = opt.main_grads() if backend.masters else [p.grad for p in params]
            assert device["grads"] == _nbytes(grads)
            moments = _nbytes(s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
            side = host if options.optimizer_cpu_offload else device
            assert side["optimizer"] == moments
            if backend.masters:
                assert side.get("master_weights", side.get("params")) == _nbytes(opt.masters)


def _fake_model(tmp_path, tiny_model_dir, preset: str):
    """A model directory with the tiny model's tokenizer and `preset`'s config.json, without
    weights: the plan reads the config only, and a refused call builds nothing."""
    out = tmp_path / preset
    shutil.copytree(tiny_model_dir, out)
    (out / "model.safetensors").unlink()
    config = json.loads((out / "config.json").read_text())
    config.pop("layer_types", None)  # one per tiny layer
    (out / "config.json").write_text(json.dumps(config | PRESETS[preset]))
    return out


def _predict(preset: str, **options):
    config = dict(PRESETS[preset], model_type="qwen2")
    return memfit.predictor(BackendConfig(**options), config, world_size=1)


def test_auto_picks_the_least_recompute_that_fits_then_the_largest_cap():
    megatron = dict(backend="megatron", dtype="bf16", use_distributed_optimizer=True)
    predict = _predict("qwen2.5-3b", **megatron)
    room = memfit.room(H100)

    def choose(budget=room, **kw):
        return memfit.choose(predict, **dict(dict(recompute="auto", max_tokens=0, longest=1,
                                                  budget=budget, backend="megatron"), **kw))

    # 3B on an 80 GB H100: without recompute even 4,096 tokens do not fit, full recompute does
    assert predict("none", 4096) > room and predict("selective", 4096) > room
    recompute, cap, _ = full_cap = choose()
    assert recompute == "full" and cap % 1024 == 0 and cap >= 4096
    assert predict("full", cap) <= room < predict("full", cap + 1024)
    assert choose(max_tokens=4096) == ("full", 4096, None)
    assert choose(recompute="full", max_tokens=0) == ("full", cap, None)
    # smaller logprob chunks before more recompute: 1,024 rows leave room for no recompute
    assert predict("none", 4096, 2048) > room >= predict("none", 4096, 1024)
    assert choose(chunks=(None, 2048, 1024)) == ("none", 4096, 1024)
    # on an H200 no recompute fits 4,096 tokens or more: less recompute beats a larger cap
    big = memfit.room(H200)
    recompute, cap, _ = choose(budget=big)
    assert recompute == "none" and cap >= 4096 and predict("full", 65536) <= big
    # the optimizer offloaded: no recompute on the H100 too
    offloaded = _predict("qwen2.5-3b", optimizer_cpu_offload=True, **megatron)
    recompute, cap, _ = memfit.choose(offloaded, recompute="auto", max_tokens=0, longest=1,
                                      budget=room, backend="megatron")
    assert recompute == "none" and offloaded("none", cap) <= room
    # a sample longer than the explicit cap is planned at its own length
    assert choose(max_tokens=1024, longest=full_cap[1]) == ("full", 1024, None)
    with pytest.raises(ConfigError, match="the longest sample"):
        choose(max_tokens=1024, longest=full_cap[1] + 2048)
    # the torch backend never picks selective
    torch_predict = _predict("qwen2.5-3b", dtype="bf16")
    assert memfit.choose(torch_predict, recompute="auto", max_tokens=0, longest=1,
                         budget=big, backend="torch")[0] in ("none", "full")


def test_nothing_fits_is_refused_in_one_line_naming_the_knobs():
    predict = _predict("qwen2.5-7b", backend="megatron", dtype="bf16")
    with pytest.raises(ConfigError) as e:
        memfit.choose(predict, recompute="auto", max_tokens=0, longest=1,
                      budget=memfit.room(H100), backend="megatron")
    message = str(e.value)
    assert "\n" not in message and "GiB of 73.2 GiB" in message
    # full recompute was the last try: the message names the other knobs
    assert "--recompute full" not in message
    for knob in ("--max-tokens-per-microbatch", "--optimizer-cpu-offload", "more GPUs"):
        assert knob in message
    # the 7B with its optimizer offloaded fits an H100 (weights and fp32 grads: 6 bytes each)
    offloaded = _predict("qwen2.5-7b", backend="megatron", dtype="bf16",
                         use_distributed_optimizer=True, optimizer_cpu_offload=True)
    assert memfit.choose(offloaded, recompute="auto", max_tokens=0, longest=1,
                         budget=memfit.room(H100), backend="megatron")[1] >= 4096


def test_without_a_device_auto_is_no_recompute_and_the_default_cap(tiny_model_dir):
    cfg = TrainConfig(rollouts=["x"], load=str(tiny_model_dir), recompute="auto",
                      max_tokens_per_microbatch=0, device="cpu")
    assert memfit.fit(cfg, tiny_model_dir) == {"recompute": "none",
                                               "max_tokens_per_microbatch": 4096}


def test_fit_with_a_device_budget_reads_the_model_config(tmp_path, tiny_model_dir):
    model = _fake_model(tmp_path, tiny_model_dir, "qwen2.5-3b")
    cfg = TrainConfig(rollouts=["x"], load=str(model), backend="megatron", dtype="bf16",
                      recompute="auto", max_tokens_per_microbatch=0, device_memory_gb=H100 / 1e9)
    assert memfit.fit(cfg, model, longest=900) == {
        "recompute": "none", "max_tokens_per_microbatch": 4096, "logprob_chunk_tokens": 1024}
    explicit = TrainConfig(**dict(cfg.model_dump(exclude_defaults=True),
                                  logprob_chunk_tokens=4096))
    fitted = memfit.fit(explicit, model, longest=900)
    assert fitted["recompute"] == "full" and fitted["max_tokens_per_microbatch"] >= 4096
    assert fitted["logprob_chunk_tokens"] == 4096  # set explicitly: kept


@pytest.mark.parametrize("backend", ["megatron", "torch"])
def test_a_setting_that_cannot_fit_is_refused_before_the_model_is_built(
        tmp_path, tiny_model_dir, train_shard, backend):
    model = _fake_model(tmp_path, tiny_model_dir, "qwen2.5-3b")
    save = tmp_path / "run" / "ckpt"
    result = CliRunner().invoke(main, [
        "train", "--rollouts", str(train_shard), "--load", str(model), "--save", str(save),
        "--backend", backend, "--dtype", "bf16", "--recompute", "none",
        "--max-tokens-per-microbatch", "16384", "--device-memory-gb", "85"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "train step needs" in lines[0] and "GiB of" in lines[0]
    for knob in ("--recompute full", "--max-tokens-per-microbatch",
                 "--optimizer-cpu-offload", "more GPUs"):
        assert knob in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_colocated_loop_plans_the_megatron_trainer_beside_the_engines():
    from rltool.train import memplan

    hf = dict(PRESETS["qwen2.5-3b"], model_type="qwen2")
    options = TrainConfig(rollouts=["x"], load="x", backend="megatron", dtype="bf16",
                          recompute="full", max_tokens_per_microbatch=4096)
    train, resident = memfit.trainer_bytes(options, hf)
    p = memplan.plan(memplan.Shape.of(hf), offload="none", micro_batch_tokens=4096,
                     recompute=True, kv_tokens=65536, trainer=(train, resident))
    shape = mplan.ModelShape.of(hf)
    want = mplan.plan(shape, mplan.Layout(), dtype="bf16", recompute="full",
                      micro_batch_tokens=4096)
    assert p.peak("train") - p.train["engine_weights"] - p.train["kv_pool"] == want.device_bytes
    assert p.rollout["optimizer"] == want.device["optimizer"] and "layers" not in p.rollout
    with pytest.raises(ConfigError, match="offload none keeps .* optimizer_cpu_offload"):
        memplan.choose(memplan.Shape.of(hf), offload="none", device_bytes=70 << 30,
                       host_bytes=10**12, micro_batch_tokens=4096, recompute=True,
                       kv_tokens=65536, trainer=(train, resident))


def two_ranks(model: Path, out: Path, layout: dict) -> list[dict]:
    """tests/train/megatron_memplan_ranks.py on 2 gloo ranks: each rank's real and planned
    bytes."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(root / "tests" / "train" / "megatron_memplan_ranks.py"), str(model), str(out),
         json.dumps(layout)], capture_output=True, text=True, timeout=400,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", [
    ("qwen2", {"tensor_model_parallel_size": 2}),
    ("qwen2", {"pipeline_model_parallel_size": 2}),
    ("qwen2", {"use_distributed_optimizer": True}),
    ("qwen3_moe", {"expert_model_parallel_size": 2, "use_distributed_optimizer": True}),
], ids=["tp2", "pp2", "dp2-distopt", "ep2-distopt"])
def test_megatron_state_bytes_per_shard_on_two_ranks(models, tmp_path, arch, layout):
    """Each of 2 gloo ranks counts its real tensors: weights and gradient buffers equal the
    plan's for its TP/PP/EP shard and pipeline stage, and so does the optimizer state, except
    where the distributed optimizer shards a buffer over 2 ranks: a rank's share of the padded
    buffer (the plan's count) may include padding that holds no state."""
    ranks = two_ranks(models(arch, "tiny"), tmp_path, layout)
    sharded = layout.get("use_distributed_optimizer", False)
    for rank in ranks:
        real, plan = rank["real"], rank["plan"]
        assert plan["weights"] == real["weights"] and plan["grads"] == real["grads"], rank
        if sharded:
            assert 0 <= plan["optimizer"] - real["optimizer"] <= 8 * rank["padding"], rank
        else:
            assert plan["optimizer"] == real["optimizer"], rank
    if "pipeline_model_parallel_size" in layout:
        assert {r["stage"] for r in ranks} == {"first", "last"}


def test_a_backend_built_with_auto_takes_the_plan(tmp_path, tiny_model_dir):
    """Callers that build a backend without the train stage (benchmarks, the align gate) get the
    plan's recompute and chunk for 4,096-token micro-batches."""
    from rltool.train.backend import build_backend

    backend = build_backend(tiny_model_dir, options=BackendConfig(
        device="cpu", recompute="auto", device_memory_gb=40.0))
    assert backend.options.recompute == "none" and backend.options.logprob_chunk_tokens == 4096


def test_the_offload_must_fit_the_host():
    """The 7B shapes' optimizer on the host: 16 bytes an element (fp32 master, moments, pinned
    gradient copy), 113.5 GiB; a 128 GiB host with 120 GiB available holds 90 GiB of pinned
    buffers (memplan.HOST_SHARE), so the whole optimizer is refused there and 3/4 of it is not."""
    hf = dict(PRESETS["qwen2.5-7b"], model_type="qwen2")
    options = BackendConfig(backend="megatron", dtype="bf16", use_distributed_optimizer=True,
                            optimizer_cpu_offload=True)
    with pytest.raises(ConfigError, match=r"needs 113\.5 GiB of host memory, 75% of the "
                                          r"available is 90\.0 GiB: use a smaller "
                                          r"--optimizer-offload-fraction"):
        memfit.check_host(options, hf, world_size=1, available=120 << 30)
    three_quarters = options.model_copy(update={"optimizer_offload_fraction": 0.75})
    need = memfit.check_host(three_quarters, hf, world_size=1, available=120 << 30)
    assert need == pytest.approx(0.75 * 113.5 * GIB, rel=1e-3)
    torch_options = BackendConfig(dtype="bf16", param_dtype="bf16", optimizer_cpu_offload=True)
    n = 7_615_616_512
    assert memfit.check_host(torch_options, hf, world_size=1, available=10**13) == 16 * n
