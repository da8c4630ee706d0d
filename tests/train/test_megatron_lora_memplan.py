"""The megatron memory plan under `--lora-rank` (rltool.train.megatron_memplan's `Lora`): its
weights, gradient buffers and optimizer state against the real tensors of LoRA megatron trainers
built on the CPU (fp32, gloo; TP1 in this process, TP2 on two torchrun ranks; with and without
the distributed optimizer), the adapter path's saved activations against the tensors autograd
keeps, and the choice it makes for a device where full training is refused."""

from __future__ import annotations

import json

import pytest
import torch

from rltool.data.models import PRESETS
from rltool.errors import ConfigError
from rltool.train import megatron_memplan as mplan
from rltool.train import memfit
from rltool.train.backend import MicroBatch
from rltool.train.config import BackendConfig, TrainConfig
from rltool.train.launch import process_group_scope
from tests.train.test_megatron_memplan import (H100, MB, _fake_model, _megatron_bytes, loss_fn,
                                               two_ranks)

ODD = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("qwen2")


def _plan_state(model, options: BackendConfig, *, world_size: int = 1):
    hf = json.loads((model / "config.json").read_text())
    fraction = 1.0 if options.optimizer_cpu_offload else 0.0
    return mplan.state_bytes(mplan.ModelShape.of(hf), mplan.Layout.of(options,
                                                                      world_size=world_size),
                             dtype=options.dtype, offload_fraction=fraction,
                             lora=memfit.megatron_lora(options, hf))


@pytest.mark.parametrize("extra", [
    dict(lora_rank=4),
    dict(lora_rank=4, use_distributed_optimizer=True),
    dict(lora_rank=3, lora_target_modules=ODD, use_distributed_optimizer=True),
    dict(lora_rank=4, use_distributed_optimizer=True, optimizer_cpu_offload=True),
], ids=["tp1", "tp1-distopt", "tp1-distopt-padded", "tp1-offload"])
def test_lora_state_bytes_are_the_real_tensors(model, extra):
    from rltool.train.megatron_backend import MegatronBackend

    options = BackendConfig(backend="megatron", device="cpu", **extra)
    with process_group_scope():
        backend = MegatronBackend(model, options=options)
        backend.train_step([MB], loss_fn, temperature=1.0)  # Adam's state exists after a step
        real = _megatron_bytes(backend)
        frozen = sum(p.numel() for p in backend.module.parameters() if not p.requires_grad)
    device, host = _plan_state(model, options)
    assert device["weights"] == real["weights"] and device["grads"] == real["grads"]
    assert device.get("optimizer", 0) == real["optimizer"] and host.get("optimizer", 0) == \
        real["host"]
    assert "master_weights" not in device
    # the base's weights are frozen, unbuffered: only the adapters have gradients
    adapters = real["grads"] // 4
    assert device["weights"] - 4 * adapters == 4 * frozen
    if extra["lora_rank"] == 3:  # rank 3: the distributed optimizer pads the adapters' buffer
        numels = mplan.adapter_params(mplan.ModelShape.of(backend.hf_config),
                                      mplan.Layout(distributed_optimizer=True),
                                      memfit.megatron_lora(options, backend.hf_config),
                                      stage="last")
        assert adapters > sum(numels) and real["optimizer"] == 8 * sum(numels)


@pytest.mark.parametrize("layout", [
    {"tensor_model_parallel_size": 2, "use_distributed_optimizer": True, "lora_rank": 3},
    pytest.param({"tensor_model_parallel_size": 2, "lora_rank": 3,
                  "lora_target_modules": ODD}, marks=pytest.mark.slow),
], ids=["tp2-distopt", "tp2"])
def test_lora_state_bytes_per_tp_shard_on_two_ranks(model, tmp_path, layout):
    """Each TP rank holds its shards of the base and of the adapters (a column-parallel
    linear's lora_B and a row-parallel one's lora_A split): the plan equals its real tensors."""
    ranks = two_ranks(model, tmp_path, layout)
    for rank in ranks:
        real, plan = rank["real"], rank["plan"]
        assert plan["weights"] == real["weights"] and plan["grads"] == real["grads"], rank
        assert plan["optimizer"] == real["optimizer"], rank  # TP2 on 2 ranks: DP 1
    options = BackendConfig(backend="megatron", **layout)
    one = _plan_state(model, options.model_copy(
        update={"tensor_model_parallel_size": 1}))[0]
    assert ranks[0]["plan"]["grads"] < one["grads"]  # the split adapters' shards


def _saved_by_adapters(backend, batch: MicroBatch) -> int:
    """Bytes of the distinct storages autograd keeps from inside the adapters' forward (the
    adapted linear's input and the parameters themselves excluded) over one train step."""
    params = {p.untyped_storage().data_ptr() for p in backend.module.parameters()}
    current: list[int | None] = [None]  # the input's storage inside an adapter path, else None
    seen, keep = {}, []

    def wrap(method):
        def adapter_path(x):
            current[0] = x.untyped_storage().data_ptr()
            try:
                return method(x)
            finally:
                current[0] = None
        return adapter_path

    for linear in backend.lora.linears:
        name = "_column" if linear.kind == "column" else "_row"
        setattr(linear, name, wrap(getattr(linear, name)))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if current[0] not in (None, ptr) and ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
            keep.append(t.untyped_storage())  # alive: no other tensor reuses its address
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        backend.train_step([batch], loss_fn, temperature=1.0)
    return sum(seen.values())


@pytest.mark.parametrize("extra", [dict(lora_rank=4), dict(lora_rank=3, lora_dropout=0.1,
                                                            lora_target_modules=ODD)],
                         ids=["all-linear", "dropout"])
def test_the_adapters_saved_activations_are_the_real_tensors(model, extra):
    from rltool.train.megatron_backend import MegatronBackend

    options = BackendConfig(backend="megatron", device="cpu", recompute="none", **extra)
    with process_group_scope():
        backend = MegatronBackend(model, options=options)
        real = _saved_by_adapters(backend, MB)
    tokens = sum(len(s) for s in MB.tokens)
    shape = mplan.ModelShape.of(backend.hf_config)
    lora = memfit.megatron_lora(options, backend.hf_config)
    per_layer = mplan.lora_layer_bytes(shape, mplan.Layout(), lora, tokens=tokens, dtype="fp32")
    # the first layer's input needs no gradient (the embedding is frozen): its linear_qkv keeps
    # neither its lora_A copy nor a dropout mask, which the plan counts in every layer
    qkv = len({"q_proj", "k_proj", "v_proj"} & set(lora.targets))
    first = 4 * lora.rank * shape.hidden * qkv + (4 * tokens * shape.hidden if qkv and
                                                   lora.dropout else 0)
    # the CPU's dropout keeps a float mask (4 bytes an element), CUDA's fused one a bool mask
    widths = sum(width for _, width, _, _ in mplan.lora_linears(shape, mplan.Layout(), lora))
    cpu_masks = 3 * tokens * widths if lora.dropout else 0
    assert real == shape.layers * (per_layer + cpu_masks) - first
    full = mplan.layer_bytes(shape, mplan.Layout(), tokens=tokens, dtype="fp32",
                             recompute="none")
    assert mplan.layer_bytes(shape, mplan.Layout(), tokens=tokens, dtype="fp32",
                             recompute="none", lora=lora) == full + per_layer


def test_full_training_is_refused_where_lora_fits(tmp_path, tiny_model_dir):
    """The 7B shapes in bf16 on an 80 GB H100: full training needs more than the device in
    every setting the plan tries; rank-16 adapters on every linear fit without recompute."""
    model = _fake_model(tmp_path, tiny_model_dir, "qwen2.5-7b")
    cfg = dict(rollouts=["x"], load=str(model), backend="megatron", dtype="bf16",
               recompute="auto", max_tokens_per_microbatch=0, device_memory_gb=H100 / 1e9)
    with pytest.raises(ConfigError) as e:
        memfit.fit(TrainConfig(**cfg), model, longest=900)
    message = str(e.value)
    assert "\n" not in message and "train step needs" in message
    for knob in ("--max-tokens-per-microbatch", "--optimizer-cpu-offload", "more GPUs"):
        assert knob in message
    lora = TrainConfig(**cfg, lora_rank=16)
    fitted = memfit.fit(lora, model, longest=900)
    assert fitted["recompute"] == "none" and fitted["max_tokens_per_microbatch"] >= 4096
    hf = dict(PRESETS["qwen2.5-7b"], model_type="qwen2")
    shape = mplan.ModelShape.of(hf)
    device = mplan.state_bytes(shape, mplan.Layout(), dtype="bf16",
                               lora=memfit.megatron_lora(lora, hf))[0]
    n = sum(sum(g) for g in mplan.local_params(shape, mplan.Layout(), stage="last"))
    adapters = 16 * 28 * sum(i + o for i, o in [(3584, 3584), (3584, 512), (3584, 512),
                                                (3584, 3584), (3584, 18944), (3584, 18944),
                                                (18944, 3584)])
    assert device == {"weights": 2 * n + 4 * adapters, "grads": 4 * adapters,
                      "optimizer": 8 * adapters}
    # the colocated loop's resident trainer is the same state
    resident = memfit.trainer_bytes(lora.model_copy(update=fitted), hf)[1]
    assert resident == device
    predict = memfit.predictor(lora, hf, world_size=1)
    assert predict("none", 4096) <= memfit.room(H100) < \
        memfit.predictor(TrainConfig(**cfg), hf, world_size=1)("full", 1024)


def test_moe_mlp_targets_are_refused_by_the_plan_too():
    hf = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 60, "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 32}
    with pytest.raises(ConfigError, match="does not adapt MoE experts"):
        memfit.predictor(BackendConfig(backend="megatron", lora_rank=4), hf, world_size=1)
    attention = BackendConfig(backend="megatron", lora_rank=4,
                              lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    assert memfit.predictor(attention, hf, world_size=1)("none", 1024) > 0
