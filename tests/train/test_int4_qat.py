"""INT4 QAT (`--int4-qat`, rltool.train.int4_qat) on the torch backend, on CPU in fp32: the
trainer's forward equals the builtin engine serving the `rltool convert int4` checkpoint of the
same weights; its gradient is the straight-through one; the optimizer steps and the checkpoints
hold the unquantized weights; bad settings are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from rltool.cli import main
from rltool.convert import int4
from rltool.convert.fp8 import DequantConfig
from rltool.engine.dense_model import load_model
from rltool.errors import ConfigError
from rltool.train import int4_qat
from rltool.train.backend import MicroBatch
from rltool.train.config import BackendConfig
from rltool.train.torch_backend import TorchBackend

IDS = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 12]
START = 4


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory):
    """(int4 checkpoint, its dequantized checkpoint) of tiny_model_dir, `convert int4`
    defaults."""
    root = tmp_path_factory.mktemp("int4-qat")
    q, d = root / "int4", root / "deq"
    int4.quantize_checkpoint(int4.Int4Config(hf=tiny_model_dir, out=q, workers=1))
    int4.dequantize_checkpoint(DequantConfig(hf=q, out=d, dtype="fp32", workers=1))
    return q, d


def _backend(model_dir, **options):
    return TorchBackend(model_dir, options=BackendConfig(device="cpu", **options))


def _engine_logprobs(model_dir):
    """The builtin engine's logprobs of IDS[START:] (its own CPU forward of the checkpoint)."""
    import torch.nn.functional as F

    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    ids, pos = torch.tensor(IDS), torch.arange(len(IDS))

    def attend(layer, q, k, v):
        model.rope_store(q, k, v, pos)
        return F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            enable_gqa=True).transpose(0, 1)

    logits = model.logits(model.hidden(ids, attend)).double()
    lp = torch.log_softmax(logits, dim=-1)[START - 1:-1]
    return lp.gather(1, ids[START:, None]).squeeze(1)


def _trainer_logprobs(backend):
    out = backend.forward_logprobs(MicroBatch([0], [IDS], [START]), temperature=1.0)
    return out.logprobs[0].double()


def test_targets_are_the_weights_convert_int4_quantizes(tiny_model_dir, converted):
    backend = _backend(tiny_model_dir, int4_qat=True)
    packed = {k.removesuffix(int4.PACKED) + "weight" for k in load_file(
        next(converted[0].glob("*.safetensors"))) if k.endswith(int4.PACKED)}
    assert sorted(backend.qat.names) == sorted(packed) and len(packed) == 14


def test_fake_quantized_weights_are_the_dequantized_checkpoint_bit_for_bit(tiny_model_dir,
                                                                           converted):
    backend = _backend(tiny_model_dir, int4_qat=True)
    dequantized = load_file(next(converted[1].glob("*.safetensors")))
    params = dict(backend.inner.named_parameters())
    for name in backend.qat.names:
        fake = int4_qat.fake_quantize(params[name], fmt=backend.qat.fmt, dtype=torch.float32)
        assert torch.equal(fake, dequantized[name]), name
        assert not torch.equal(fake, params[name]), name


def test_qat_forward_equals_the_engine_serving_the_int4_checkpoint(tiny_model_dir, converted):
    want = _engine_logprobs(converted[0])
    qat = _trainer_logprobs(_backend(tiny_model_dir, int4_qat=True))
    torch.testing.assert_close(qat, want, rtol=0, atol=1e-5)
    # without QAT the trainer is the unquantized model: far from the INT4 engine
    plain = _trainer_logprobs(_backend(tiny_model_dir))
    assert (plain - want).abs().max() > 1e-3


def _loss(model, weights):
    logits = model(input_ids=torch.tensor([IDS]), use_cache=False).logits[0].double()
    lp = torch.log_softmax(logits, -1)[START - 1:-1].gather(1, torch.tensor(IDS[START:])[:, None])
    return (lp.squeeze(1) * weights).sum()


def test_gradient_is_straight_through(tiny_model_dir, converted):
    """The gradient on each (unquantized) parameter equals the gradient of the same loss with
    respect to the dequantized checkpoint's weights, for quantized and float tensors alike."""
    from transformers import AutoModelForCausalLM

    weights = torch.linspace(-1.0, 2.0, len(IDS) - START, dtype=torch.float64)
    backend = _backend(tiny_model_dir, int4_qat=True)
    _loss(backend.inner, weights).backward()
    reference = AutoModelForCausalLM.from_pretrained(str(converted[1]), dtype=torch.float32)
    _loss(reference, weights).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in backend.inner.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert all(ref_grads[n].abs().sum() > 0 for n in backend.qat.names)


def test_optimizer_steps_the_unquantized_weights_and_checkpoints_hold_them(
        tiny_model_dir, converted, tmp_path):
    """One AdamW step: the parameters are the original (unquantized) weights moved by AdamW of
    the straight-through gradient, off the INT4 grid; export and the saved checkpoint hold
    them."""
    from transformers import AutoModelForCausalLM

    from rltool.train import checkpoint as ckpt

    # eps 1: the first step is ~lr * g / (|g| + 1), not ~lr * sign(g), which would turn the
    # rounding noise of a vanishing gradient (k_proj's bias) into a full step either way
    lr = 1e-2
    backend = _backend(tiny_model_dir, int4_qat=True, lr=lr, clip_grad=0.0, adam_eps=1.0,
                       micro_batch_layout="padded")
    weights = torch.linspace(-1.0, 2.0, len(IDS) - START, dtype=torch.float64)

    def loss_fn(out, unit):
        return (out.logprobs[0].double() * weights).sum(), {}

    backend.train_step([MicroBatch([0], [IDS], [START])], loss_fn, temperature=1.0)
    # the reference: AdamW on the original weights with the dequantized model's gradient
    original = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(converted[1]), dtype=torch.float32)
    _loss(reference, weights).backward()
    grads = dict(reference.named_parameters())
    params = list(original.parameters())
    for (name, p) in original.named_parameters():
        p.grad = grads[name].grad
    torch.optim.AdamW(params, lr=lr, foreach=True, weight_decay=0.0, betas=(0.9, 0.999),
                      eps=1.0).step()
    trained = dict(backend.inner.named_parameters())
    for name, p in original.named_parameters():
        torch.testing.assert_close(trained[name].detach(), p.detach(), rtol=0, atol=1e-7,
                                   msg=name)
    start = load_file(next(tiny_model_dir.glob("*.safetensors")))
    assert min((trained[n] - start[n]).abs().max() for n in backend.qat.names) > 1e-5
    exported = backend.export_hf_state_dict()
    backend.save(tmp_path / "step-000001", trainer_state={}, data_tensors={}, config_toml="")
    saved = ckpt.read_tensors(next((tmp_path / "step-000001" / ckpt.MODEL_DIR)
                                   .glob("*.safetensors")))
    for name in backend.qat.names:
        fake = int4_qat.fake_quantize(trained[name], fmt=backend.qat.fmt, dtype=torch.float32)
        assert not torch.equal(trained[name], fake), name
        assert torch.equal(exported[name], trained[name].detach()), name
        assert torch.equal(saved[name], trained[name].detach()), name


def test_bf16_parameters_step_fp32_masters_off_the_int4_grid(tiny_model_dir):
    """--dtype bf16 --param-dtype bf16: the forward fake-quantizes the bf16 parameters as
    `--precision int4` publishes bf16 weights (bf16 scales); AdamW steps the fp32 masters, which
    the export holds, unquantized, and the bf16 parameters are their rounding."""
    backend = _backend(tiny_model_dir, int4_qat=True, dtype="bf16", param_dtype="bf16", lr=1e-2,
                       clip_grad=0.0, adam_eps=1.0, micro_batch_layout="padded")
    params = dict(backend.inner.named_parameters())
    name = backend.qat.names[0]
    fake = int4_qat.fake_quantize(params[name], fmt=backend.qat.fmt, dtype=torch.bfloat16)
    published, _ = int4.quantize_state({name: params[name].detach()}, backend.qat.fmt)
    q = int4.read_int4_tensor(published, name, published.__getitem__, where="test")
    assert q.scale.dtype == torch.bfloat16
    assert torch.equal(fake, int4.dequantize_int4(q, dtype=torch.bfloat16))
    start = load_file(next(tiny_model_dir.glob("*.safetensors")))

    def loss_fn(out, unit):
        return out.logprobs[0].float().sum(), {}

    backend.train_step([MicroBatch([0], [IDS], [START])], loss_fn, temperature=1.0)
    exported = backend.export_hf_state_dict()
    for name in backend.qat.names:
        master = exported[name]
        assert master.dtype == torch.float32 and params[name].dtype == torch.bfloat16
        assert (master - start[name]).abs().max() > 1e-5, name
        assert torch.equal(params[name].detach(), master.to(torch.bfloat16)), name
        grid = int4_qat.fake_quantize(master, fmt=backend.qat.fmt, dtype=torch.float32)
        assert not torch.equal(master, grid), name


def test_fused_experts_are_quantized_as_the_checkpoints_per_expert_weights(tiny_model_factory):
    """qwen3_moe: transformers fuses the experts into 3-D tensors; QAT targets exactly them
    (slime's MoE ignore list) and fake-quantizes each expert's gate, up and down weights as
    `convert int4` quantizes the checkpoint's per-expert tensors."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("qwen3_moe", 0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    qat = int4_qat.for_backend(model, BackendConfig(int4_qat=True, int4_qat_group_size=16,
                                                    int4_qat_symmetric=False))
    assert qat.names and all(n.split(".")[-2] == "experts" for n in qat.names)
    checkpoint = load_file(next(model_dir.glob("*.safetensors")))
    fmt = qat.fmt
    expected = set()
    for name in checkpoint:
        if fmt.quantizes(name, tuple(checkpoint[name].shape)):
            expected.add(name)
    assert expected and all(".experts." in n for n in expected)
    params = dict(model.named_parameters())
    for name in qat.names:
        layer = name.rsplit(".", 1)[0]
        fake = int4_qat.fake_quantize(params[name], fmt=fmt, dtype=torch.float32)
        projs = int4_qat.FUSED_EXPERTS[name.rsplit(".", 1)[1]]
        for e in range(fake.shape[0]):
            rows = fake[e].chunk(len(projs), dim=0)
            for proj, got in zip(projs, rows):
                key = f"{layer}.{e}.{proj}.weight"
                expected.discard(key)
                q = int4.quantize_int4(checkpoint[key], group_size=16, symmetric=False)
                assert torch.equal(got, int4.dequantize_int4(q, dtype=torch.float32)), key
    assert not expected  # every INT4 tensor of the checkpoint was compared


def test_group_size_that_does_not_divide_in_features_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"--int4-qat-group-size 48: model\.layers\.0\.self_attn"
                                          r"\.q_proj\.weight has 64 in-features"):
        _backend(tiny_model_dir, int4_qat=True, int4_qat_group_size=48)


def test_default_group_size_is_the_converts():
    assert BackendConfig().int4_qat_group_size == int4.DEFAULT_GROUP_SIZE


@pytest.mark.parametrize("extra,message", [
    (["--backend", "megatron"], "--int4-qat runs on the torch backend only"),
    (["--precision", "int4", "--int4-qat-group-size", "16"],
     "differ from what --precision int4 publishes"),
])
def test_cli_refusals(tiny_model_dir, train_shard, tmp_path, extra, message):
    result = CliRunner().invoke(main, ["train", "--rollouts", str(train_shard), "--load",
                                       str(tiny_model_dir), "--int4-qat", *extra,
                                       "--save", str(tmp_path / "ckpt")])
    assert result.exit_code == 2, result.output
    assert message in result.output and not (tmp_path / "ckpt").exists()


def test_cli_group_size_refusal_names_the_tensor(tiny_model_dir, train_shard, tmp_path):
    result = CliRunner().invoke(main, ["train", "--rollouts", str(train_shard), "--load",
                                       str(tiny_model_dir), "--int4-qat",
                                       "--int4-qat-group-size", "48",
                                       "--save", str(tmp_path / "ckpt")])
    assert result.exit_code == 2, result.output
    assert "q_proj.weight has 64 in-features" in result.output


def test_cli_trains_with_int4_qat(tiny_model_dir, train_shard, tmp_path):
    result = CliRunner().invoke(main, ["train", "--rollouts", str(train_shard), "--load",
                                       str(tiny_model_dir), "--int4-qat", "--num-steps", "1",
                                       "--save", str(tmp_path / "ckpt"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["optimizer_steps"] == 1
    saved = (tmp_path / "ckpt" / "step-000001" / "config.toml").read_text()
    assert "int4_qat = true" in saved


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one(tiny_model_dir, train_shard, tmp_path, parallel):
    """DDP and FSDP2 (2 gloo ranks): the hooks find the parameters each wrapper hands the
    forward (FSDP's unsharded ones inside a sharded layer), so two ranks train the weights one
    process trains, within the 1e-5 of tests/train/test_distributed.py. One step: after it the
    ranks' weights differ from one process's in the last bits, and a weight that close to a
    rounding boundary rounds the other way in the next forward, a jump of a whole INT4 step.
    Adam's eps 1e-6: its first step is ~lr * sign(g), which for a near-zero gradient turns the
    ranks' summation order into up to 1.1e-5 here with the default 1e-8."""
    from rltool.train import run
    from rltool.train.config import TrainConfig
    from tests.helpers.torchrun import train_cli

    args = dict(lr=3e-3, max_tokens_per_microbatch=24, global_batch_size=6, num_steps=1,
                micro_batch_layout="padded", adam_eps=1e-6)
    run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir), int4_qat=True,
                    publish=str(tmp_path / "single"), **args))
    want = load_file(tmp_path / "single" / "weight_v000001" / "model.safetensors")
    proc = train_cli(["--rollouts", str(train_shard), "--load", str(tiny_model_dir),
                      "--publish", str(tmp_path / "weights"), "--parallel", parallel,
                      "--nproc-per-node", "2", "--int4-qat", "--json",
                      *[f"--{k.replace('_', '-')}={v}" for k, v in args.items()]])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = load_file(tmp_path / "weights" / "weight_v000001" / "model.safetensors")
    plain = tmp_path / "plain"
    run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir), publish=str(plain),
                    **args))
    unquantized = load_file(plain / "weight_v000001" / "model.safetensors")
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=0, atol=1e-5), name
    assert max((want[n] - unquantized[n]).abs().max() for n in want) > 1e-4
