"""`--backend megatron` against the torch backend: one GRPO step on a fixed shard of 12 samples.

Layouts: TP1 (one process; also with the distributed optimizer), TP2, PP2 (tiny qwen2) and EP2
(tiny qwen3_moe), the last three as 2 gloo ranks under torchrun. Checked for each: the old logprobs
recomputed before the step (saved in the checkpoint's data.safetensors) within 1e-5 of the torch
backend's, the loss terms and the grad norm within 1e-5, and every updated weight within 1e-5.

Why 1e-5 for the weights: the forward passes agree to float32 rounding, but Adam's first step moves
each weight by lr * g / (|g| + eps), so an entry whose gradient is about eps (1e-8) turns a
last-bits difference of g into up to ~1e-6 of its update (lr 3e-3); every other entry moves by
the same lr * sign(g) in both backends.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rltool.errors import ConfigError
from rltool.train import run
from rltool.train.backend import ForwardOutput, MicroBatch
from rltool.train.config import BackendConfig, TrainConfig
from rltool.train.launch import process_group_scope
from tests.helpers.shards import REWARDS, make_shard, shard_rows
from tests.helpers.torchrun import train_cli

# Adam's first step moves each weight by lr * g / (|g| + eps): with the default eps (1e-8) a
# gradient of ~1e-8 turns fp32 rounding differences between the backends (different GEMM shapes:
# the response rows only, vocabulary shards under TP) into weight differences of up to lr. eps
# 1e-6 bounds that amplification, so weights agree within 1e-5 while a wrong gradient still moves
# them by ~lr.
ARGS = dict(lr=3e-3, max_tokens_per_microbatch=24, global_batch_size=12, num_steps=1,
            entropy_coef=0.01, adam_eps=1e-6)
METRICS = ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm")
STEP1 = Path("step-000001")


@pytest.fixture(scope="module")
def shards(tiny_model_factory, tmp_path_factory):
    """arch -> (model dir, shard dir): the 12-sample shard of each tiny model."""
    out = {}
    for arch in ("qwen2", "qwen3_moe"):
        model = tiny_model_factory(arch)
        out[arch] = model, make_shard(tmp_path_factory.mktemp(arch) / "rollouts" / "step-000001",
                                      model, shard_rows(REWARDS), temperature=0.8)
    return out


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors (what the torch backend exports) under the per-expert
    names of HF checkpoints (what the megatron backend exports and the source model holds)."""
    out = {}
    for name, tensor in state.items():
        prefix, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
        elif kind == "down_proj" and prefix.endswith("experts"):
            for e, down in enumerate(tensor):
                out[f"{prefix}.{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out


@pytest.fixture(scope="module")
def torch_reference(shards, tmp_path_factory):
    """arch -> the torch backend's step: (first metrics row, weights, old logprobs)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            model, shard = shards[arch]
            root = tmp_path_factory.mktemp(f"torch-{arch}")
            result = run(TrainConfig(rollouts=[str(shard)], load=str(model),
                                     save=str(root / "ckpt"), **ARGS))
            cache[arch] = (result.metrics[0], _step_outputs(root / "ckpt" / STEP1))
        return cache[arch]

    return get


def _step_outputs(ckpt: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    weights = _per_expert(load_file(ckpt / "model" / "model.safetensors"))
    return weights, load_file(ckpt / "data.safetensors")["old_logprobs"]


def _assert_matches(reference, metrics: dict, ckpt: Path) -> None:
    ref_metrics, (ref_weights, ref_logprobs) = reference
    weights, logprobs = _step_outputs(ckpt)
    assert torch.allclose(logprobs, ref_logprobs, rtol=0, atol=1e-5), \
        (logprobs - ref_logprobs).abs().max()
    for name in METRICS:
        assert metrics[name] == pytest.approx(ref_metrics[name], rel=0, abs=1e-5), name
    assert weights.keys() == ref_weights.keys()
    for name, tensor in ref_weights.items():
        assert torch.allclose(weights[name], tensor, rtol=0, atol=1e-5), name


@pytest.mark.slow
def test_tp1_matches_torch_and_resumes_bit_identically(shards, torch_reference, tmp_path):
    """Two steps with a checkpoint after each; step 1 matches the torch backend, and resuming
    from step 1's checkpoint gives step 2's weights, optimizer and metrics bit for bit."""
    model, shard = shards["qwen2"]
    cfg = dict(ARGS, num_steps=2, rollouts=[str(shard)], backend="megatron")
    straight = run(TrainConfig(load=str(model), save=str(tmp_path / "a"), save_interval=1, **cfg))
    _assert_matches(torch_reference("qwen2"), straight.metrics[0], tmp_path / "a" / STEP1)
    state = json.loads((tmp_path / "a" / STEP1 / "trainer_state.json").read_text())
    assert state["backend"]["name"] == "megatron"
    assert state["backend"]["tensor_model_parallel_size"] == 1
    resumed = run(TrainConfig(load=str(tmp_path / "a" / STEP1), save=str(tmp_path / "b"), **cfg))
    assert resumed.optimizer_steps == 1 and resumed.policy_version == 2
    for name in METRICS:
        assert resumed.metrics[0][name] == straight.metrics[1][name], name
    a = load_file(tmp_path / "a" / "step-000002" / "model" / "model.safetensors")
    b = load_file(tmp_path / "b" / "step-000002" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_distributed_optimizer_matches_torch_and_resumes_bit_identically(shards, torch_reference,
                                                                        tmp_path):
    """The distributed optimizer (fp32 on the CPU through megatron_compat) takes the torch
    backend's Adam step, and a fresh trainer resumes from its checkpoint bit for bit. Loading
    builds the optimizer's checkpoint template before it has stepped, when torch's Adam holds no
    per-parameter `step` yet; megatron's distributed optimizer then failed its assertion that
    every parameter's step agrees."""
    model, shard = shards["qwen2"]
    cfg = dict(ARGS, num_steps=2, rollouts=[str(shard)], backend="megatron",
               use_distributed_optimizer=True)
    straight = run(TrainConfig(load=str(model), save=str(tmp_path / "a"), save_interval=1, **cfg))
    _assert_matches(torch_reference("qwen2"), straight.metrics[0], tmp_path / "a" / STEP1)
    state = json.loads((tmp_path / "a" / STEP1 / "trainer_state.json").read_text())
    assert state["backend"]["use_distributed_optimizer"] is True
    resumed = run(TrainConfig(load=str(tmp_path / "a" / STEP1), save=str(tmp_path / "b"), **cfg))
    for name in METRICS:
        assert resumed.metrics[0][name] == straight.metrics[1][name], name
    a = load_file(tmp_path / "a" / "step-000002" / "model" / "model.safetensors")
    b = load_file(tmp_path / "b" / "step-000002" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", [
    ("qwen2", ["--tensor-model-parallel-size", "2"]),
    ("qwen2", ["--pipeline-model-parallel-size", "2"]),
    ("qwen3_moe", ["--expert-model-parallel-size", "2"]),
], ids=["tp2", "pp2", "ep2"])
def test_two_rank_layouts_match_torch(shards, torch_reference, tmp_path, arch, layout):
    model, shard = shards[arch]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()]
    proc = train_cli(["--rollouts", str(shard), "--load", str(model), "--save",
                      str(tmp_path / "ckpt"), "--backend", "megatron", "--nproc-per-node", "2",
                      "--json", *flags, *layout], timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["policy_version"] == 1
    metrics = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    _assert_matches(torch_reference(arch), metrics, tmp_path / "ckpt" / STEP1)
    state = json.loads((tmp_path / "ckpt" / STEP1 / "trainer_state.json").read_text())
    assert state["backend"]["world_size"] == 2


def test_megatron_flags_need_the_megatron_backend(shards):
    model, shard = shards["qwen2"]
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size is a megatron option"):
        TrainConfig(rollouts=[str(shard)], load=str(model), tensor_model_parallel_size=2)
    with pytest.raises(ConfigError, match="does not support ppo"):
        TrainConfig(rollouts=[str(shard)], load=str(model), backend="megatron",
                    advantage_estimator="ppo")


@pytest.mark.parametrize("recompute,want", [
    ("none", {}),
    ("selective", {"recompute_granularity": "selective"}),
    ("full", {"recompute_granularity": "full", "recompute_method": "uniform",
              "recompute_num_layers": 1}),
])
def test_recompute_maps_to_megatron_s_recompute_granularity(recompute, want):
    from rltool.train.megatron_backend import _config_overrides

    overrides = _config_overrides(BackendConfig(backend="megatron", recompute=recompute),
                                  cuda=False)
    keys = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    assert {k: overrides[k] for k in keys if k in overrides} == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cpu_refuses_megatron_mixed_precision_training(shards):
    from rltool.train.megatron_backend import MegatronBackend

    model, _ = shards["qwen2"]
    for extra in (dict(), dict(use_distributed_optimizer=True)):
        with pytest.raises(ConfigError, match="--dtype bf16 needs CUDA"):
            MegatronBackend(model, options=BackendConfig(backend="megatron", dtype="bf16",
                                                         **extra))


def test_bf16_model_holds_bf16_norms_and_computes_logprobs(shards):
    """megatron's torch-norm fallback builds fp32 norms; bf16 activations then take torch's
    unfused RMSNorm. A frozen bf16 model (allowed on the CPU) holds every parameter in bf16."""
    from rltool.train.megatron_backend import MegatronBackend

    model, _ = shards["qwen2"]
    with process_group_scope():  # the backend starts a one-process group
        backend = MegatronBackend(model, options=BackendConfig(backend="megatron", dtype="bf16",
                                                               device="cpu"), trainable=False)
        assert {p.dtype for p in backend.module.parameters()} == {torch.bfloat16}
        batch = MicroBatch([0, 1], [[5, 6, 7, 8, 9], [4, 3, 2]], [2, 1])
        out = backend.forward_logprobs(batch, temperature=1.0, with_entropy=True, top_k=2)
    assert [t.shape[0] for t in out.logprobs] == [3, 2] == [t.shape[0] for t in out.entropy]
    assert all(bool((t <= 0).all()) for t in out.logprobs)
    assert [t.shape for t in out.topk_ids] == [(3, 2), (2, 2)]


def test_a_padded_packed_row_gives_the_micro_batch_s_samples_only(shards):
    """Pipeline and expert parallelism pad every pass to a shared length with one padding
    sequence; its outputs are dropped, and the real samples' logprobs are those of the unpadded
    row (forward_logprobs concatenates units, so an extra entry would shift later samples)."""
    from rltool.train.megatron_backend import MegatronBackend

    model, _ = shards["qwen2"]
    batch = MicroBatch([0, 1], [[5, 6, 7, 8, 9], [4, 3, 2]], [2, 1])
    with process_group_scope():
        backend = MegatronBackend(model, options=BackendConfig(backend="megatron", device="cpu"),
                                  trainable=False)
        outs = []
        for length in (8, 13):
            p, params = backend._pack(batch, length)
            with torch.no_grad(), backend._hidden_out():
                hidden = backend.model(p.ids, p.position_ids, None, packed_seq_params=params)
            outs.append(backend._outputs(hidden, p, samples=2, temperature=1.0,
                                         with_entropy=False, top_k=0).logprobs)
    assert [t.shape[0] for t in outs[1]] == [3, 2]
    for exact, padded in zip(*outs):
        assert torch.allclose(exact, padded, atol=1e-6, rtol=0)


def test_logprob_outputs_reach_the_host_with_their_values_and_own_storage():
    from rltool.train.megatron_backend import OUTPUT_FIELDS, _to_host

    g = torch.Generator().manual_seed(0)

    def out(lengths: list[int], entropy: bool) -> ForwardOutput:
        return ForwardOutput(
            logprobs=[-torch.rand(n, generator=g) for n in lengths],
            entropy=[torch.rand(n, generator=g) for n in lengths] if entropy else None,
            topk_logprobs=[-torch.rand(n, 3, generator=g) for n in lengths],
            topk_ids=[torch.randint(0, 50, (n, 3), generator=g) for n in lengths])

    for entropy in (True, False):
        outputs = [out([2, 0, 3], entropy), out([1], entropy)]
        hosted = _to_host(outputs)
        assert len(hosted) == 2 and (hosted[0].entropy is None) == (not entropy)
        for name in OUTPUT_FIELDS:
            for want, got in zip(outputs, hosted):
                if getattr(want, name) is None:
                    continue
                assert len(getattr(got, name)) == len(getattr(want, name))
                for a, b in zip(getattr(want, name), getattr(got, name)):
                    assert torch.equal(a, b) and a.dtype == b.dtype and b.device.type == "cpu"
                    assert b.untyped_storage().nbytes() == b.numel() * b.element_size()
    assert _to_host([]) == []


def test_grad_norm_without_host_reads_equals_megatron_s():
    """The CUDA stand-in for megatron's plain-torch multi-tensor 2-norm (no read of each norm
    back to the host) gives its norm, as a float32 tensor [1]."""
    from megatron.core import utils

    from rltool import megatron_compat

    megatron_compat.enable_cpu()
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g) * s for n, s in [(7, 1.0), (300, 1e-3), (1, 5.0)]]
    want, _ = utils.local_multi_tensor_l2_norm(2048 * 32, None, [tensors], False)
    got, _ = megatron_compat._l2_norm(2048 * 32, None, [tensors], False)
    assert got.dtype == torch.float32 and got.shape == (1,)
    assert torch.allclose(got, want.to(got.device), rtol=1e-6)
