"""LoRA on the torch backend (`--lora-rank`, rltool.train.lora), on CPU in fp32, against PEFT:
the trainer's forward equals PEFT's with the same adapter; a train step moves only the adapters
(the base frozen, optimizer state for the adapters only); a resumed run is bit-identical to an
uninterrupted one; the published adapter is PEFT's layout and PEFT loads it; the merged publish
is W + scale * B @ A exactly; the KL reference is the base; bad settings fail in one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from rltool.cli import main
from rltool.errors import CheckpointError, ConfigError
from rltool.train import lora, run
from rltool.train.checkpoint import resolve_load
from rltool.train.backend import MicroBatch
from rltool.train.config import LORA_DEFAULT_TARGETS, BackendConfig, TrainConfig
from rltool.train.torch_backend import TorchBackend

TOKENS = [[3, 9, 4, 17, 22, 5, 8, 30], [3, 9, 4, 11, 2, 7], [6, 12, 13, 14, 15, 16, 18, 19, 20]]
STARTS = [4, 4, 5]
COMMON = dict(lr=3e-3, max_tokens_per_microbatch=40, global_batch_size=6, device="cpu")


def _backend(model_dir, **options) -> TorchBackend:
    return TorchBackend(model_dir, options=BackendConfig(device="cpu", **options))


def _randomize_b(backend: TorchBackend, seed: int = 1) -> None:
    """lora_B starts at zero (the base's forward); random values make the adapters count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in backend.inner.named_parameters():
            if name.endswith(".lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _peft_model(model_dir, adapter: dict[str, torch.Tensor], *, rank: int, alpha: float,
                targets: list[str]):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                            lora_dropout=0.0, task_type="CAUSAL_LM"))
    result = set_peft_model_state_dict(model, lora.peft_tensors(adapter))
    assert not result.unexpected_keys
    return model.eval()


def _reference_logprobs(model, tokens: list[int], start: int) -> torch.Tensor:
    """log p(token j | tokens < j) for the response tokens, in float64, from raw logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return torch.stack([logp[j - 1, tokens[j]] for j in range(start, len(tokens))])


def _loss(out, mb):
    """A policy-gradient-like loss that moves every response token."""
    total = sum((lp * (1.0 if k % 2 else -1.0)).sum() for k, lp in enumerate(out.logprobs))
    return total, {"loss": total.detach()}


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_forward_equals_peft(tiny_model_dir, layout):
    backend = _backend(tiny_model_dir, lora_rank=4, lora_alpha=16.0, micro_batch_layout=layout)
    _randomize_b(backend)
    peft = _peft_model(tiny_model_dir, backend.export_adapter(), rank=4, alpha=16.0,
                       targets=list(LORA_DEFAULT_TARGETS))
    out = backend.forward_logprobs(MicroBatch([0, 1, 2], TOKENS, STARTS), temperature=1.0)
    for got, tokens, start in zip(out.logprobs, TOKENS, STARTS):
        want = _reference_logprobs(peft, tokens, start)
        assert torch.allclose(got.double(), want, atol=1e-5)
    # the adapters matter: the base alone differs, and adapters_off gives it
    with backend.adapters_off():
        base_out = backend.forward_logprobs(MicroBatch([0], TOKENS[:1], STARTS[:1]),
                                            temperature=1.0)
    with peft.disable_adapter():
        base_want = _reference_logprobs(peft, TOKENS[0], STARTS[0])
    assert torch.allclose(base_out.logprobs[0].double(), base_want, atol=1e-5)
    assert not torch.allclose(out.logprobs[0].double(), base_want, atol=1e-3)


def test_a_train_step_moves_only_the_adapters(tiny_model_dir):
    backend = _backend(tiny_model_dir, lora_rank=2, lora_target_modules=["q_proj", "down_proj"])
    layers = backend.config.num_hidden_layers
    assert len(backend.lora.paths) == 2 * layers
    trainable = {n for n, p in backend.inner.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_key(n) for n in trainable)
    assert len(trainable) == 4 * layers
    before = {k: v.clone() for k, v in backend.inner.state_dict().items()}
    for key, value in before.items():  # PEFT's init: A Kaiming-uniform (a = sqrt(5)), B zero
        if key.endswith("lora_A.weight"):
            bound = 1.0 / value.shape[1] ** 0.5
            assert value.abs().max() <= bound and value.abs().max() > 0.5 * bound
        if key.endswith("lora_B.weight"):
            assert not value.any()
    for _ in range(2):  # B moves first (A's gradient is B^T ... = 0), then A
        backend.train_step([MicroBatch([0, 1, 2], TOKENS, STARTS)], _loss, temperature=1.0)
    after = backend.inner.state_dict()
    for key, value in before.items():
        assert torch.equal(value, after[key]) != lora.is_adapter_key(key), key
    assert len(backend.optimizer.state) == len(trainable)
    moments = sum(s["exp_avg"].numel() for s in backend.optimizer.state.values())
    assert moments == sum(p.numel() for p in backend.inner.parameters() if p.requires_grad)


def test_target_modules_that_match_nothing_are_refused_naming_the_modules(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"q_prj: no linear module .* it has "
                                          r"down_proj,gate_proj,k_proj,o_proj,q_proj,"):
        _backend(tiny_model_dir, lora_rank=2, lora_target_modules=["q_proj", "q_prj"])
    every = _backend(tiny_model_dir, lora_rank=2, lora_target_modules=["all-linear"])
    assert len(every.lora.paths) == 7 * every.config.num_hidden_layers  # lm_head left out


@pytest.mark.parametrize("options,message", [
    (dict(lora_alpha=8.0), "--lora-alpha configures LoRA: add --lora-rank"),
    (dict(lora_rank=4, lora_target_modules=["all-linear", "q_proj"]), "all-linear already"),
    (dict(lora_rank=4, lora_target_modules=[]), "is empty"),
])
def test_bad_lora_settings_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        BackendConfig(**options)


def test_lora_run_refuses_ref_and_quantized_adapter_publish(train_shard, tiny_model_dir):
    base = dict(rollouts=[str(train_shard)], load=str(tiny_model_dir), lora_rank=4)
    with pytest.raises(ConfigError, match="drop --ref"):
        TrainConfig(**base, ref=str(tiny_model_dir), kl_loss_coef=0.1)
    with pytest.raises(ConfigError, match="--lora-merge-on-publish or drop --precision"):
        TrainConfig(**base, precision="fp8")
    TrainConfig(**base, kl_loss_coef=0.1)  # the reference is the base: no --ref needed
    TrainConfig(**base, precision="fp8", lora_merge_on_publish=True)


def _lora_run(tiny_model_dir, train_shard, tmp_path, name, **extra):
    cfg = dict(rollouts=[str(train_shard)], num_epochs=2, save_interval=1, lora_rank=4,
               lora_dropout=0.1, kl_loss_coef=0.05, shuffle=True, lr_warmup_steps=1, **COMMON)
    cfg.update(extra)
    cfg.setdefault("load", str(tiny_model_dir))
    return run(TrainConfig(save=str(tmp_path / name), publish=str(tmp_path / f"w-{name}"),
                           **cfg))


def test_resume_is_bit_identical_and_the_adapter_is_published(tiny_model_dir, train_shard,
                                                              tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    full = _lora_run(tiny_model_dir, train_shard, tmp_path, "a")
    assert full.policy_version == 4
    ckpt = tmp_path / "a" / "step-000002"
    assert sorted(p.name for p in (ckpt / "adapter").iterdir()) == [lora.CONFIG_FILE,
                                                                   lora.WEIGHTS_FILE]
    assert not (ckpt / "model").exists()  # the base is --load's, never copied
    resumed = _lora_run(tiny_model_dir, train_shard, tmp_path, "b", load=str(ckpt))
    assert resumed.optimizer_steps == 2 and resumed.policy_version == 4
    for name in ("adapter/adapter_model.safetensors", "optimizer.safetensors",
                 "data.safetensors"):
        a = load_file(tmp_path / "a" / "step-000004" / name)
        b = load_file(tmp_path / "b" / "step-000004" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    for x, y in zip(full.metrics[2:], resumed.metrics):
        assert {k: v for k, v in x.items() if not k.startswith(("perf/", "time"))} == \
               {k: v for k, v in y.items() if not k.startswith(("perf/", "time"))}
    assert full.metrics[0]["train/kl_loss"] == 0.0  # the base is the reference: B starts at 0
    assert full.metrics[-1]["train/kl_loss"] > 0.0
    # the published version: PEFT's two files, loaded by PEFT itself
    published = tmp_path / "w-a" / "weight_v000004"
    assert sorted(p.name for p in published.iterdir()) == [lora.CONFIG_FILE, lora.WEIGHTS_FILE]
    config = json.loads((published / lora.CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == sorted(LORA_DEFAULT_TARGETS)
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    tensors = load_file(published / lora.WEIGHTS_FILE)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert tensors[key].shape == (4, 64) and tensors[key].dtype == torch.float32
    assert tensors[key.replace("lora_A", "lora_B")].shape[1] == 4
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(published)).eval()
    trainer = _backend(tiny_model_dir, lora_rank=4)
    trainer.load(tmp_path / "a" / "step-000004")
    out = trainer.forward_logprobs(MicroBatch([0], TOKENS[:1], STARTS[:1]), temperature=1.0)
    assert torch.allclose(out.logprobs[0].double(), _reference_logprobs(peft, TOKENS[0],
                                                                        STARTS[0]), atol=1e-5)


def test_ppo_resume_under_lora_is_bit_identical(tiny_model_dir, train_shard, tmp_path):
    """The value head trains whole beside the adapters and is checkpointed with them."""
    _lora_run(tiny_model_dir, train_shard, tmp_path, "a", advantage_estimator="ppo",
              num_epochs=1)
    _lora_run(tiny_model_dir, train_shard, tmp_path, "b", advantage_estimator="ppo",
              num_epochs=1, load=str(tmp_path / "a" / "step-000001"))
    for name in ("adapter/adapter_model.safetensors", "optimizer.safetensors",
                 "value_head.safetensors"):
        a = load_file(tmp_path / "a" / "step-000002" / name)
        b = load_file(tmp_path / "b" / "step-000002" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    head = load_file(tmp_path / "a" / "step-000002" / "value_head.safetensors")
    assert head["value_head.weight"].any()  # zero at init: it trained
    optimizer = load_file(tmp_path / "a" / "step-000002" / "optimizer.safetensors")
    assert {k.rpartition("/")[0] for k in optimizer} == {
        "value_head.weight", "value_head.bias"} | {
        k.removeprefix("base_model.model.") for k in load_file(
            tmp_path / "a" / "step-000002" / "adapter" / lora.WEIGHTS_FILE)}


def test_resume_under_other_adapters_is_refused(tiny_model_dir, train_shard, tmp_path):
    _lora_run(tiny_model_dir, train_shard, tmp_path, "a", num_epochs=1, global_batch_size=12)
    ckpt = tmp_path / "a" / "step-000001"
    with pytest.raises(CheckpointError, match="resume with --lora-rank 4 --lora-alpha 8"):
        _backend(tiny_model_dir, lora_rank=8).load(ckpt)
    with pytest.raises(CheckpointError, match="add --lora-rank|holds LoRA adapters"):
        _backend(tiny_model_dir).load(ckpt)
    # a reader of full weights (--ref, --old-actor, teachers, recompute, align-gate --weights)
    # refuses the LoRA checkpoint rather than read its base
    for path in (ckpt, tmp_path / "a"):
        with pytest.raises(CheckpointError, match="is a LoRA checkpoint"):
            resolve_load(path)
    assert resolve_load(ckpt, adapter=True).ckpt_dir == ckpt


def test_merged_publish_is_base_plus_scaled_product(tiny_model_dir, train_shard, tmp_path):
    from transformers import AutoModelForCausalLM

    backend = _backend(tiny_model_dir, lora_rank=4, lora_alpha=6.0)
    _randomize_b(backend)
    state = backend.inner.state_dict()
    merged = backend.export_hf_state_dict()
    assert not any(lora.is_adapter_key(k) for k in merged)
    scale = 6.0 / 4
    for key, value in merged.items():
        module = key.removesuffix(".weight")
        if module + ".lora_A.weight" in state:
            a, b = state[module + ".lora_A.weight"], state[module + ".lora_B.weight"]
            assert torch.equal(value, state[key] + scale * (b @ a)), key
            exact = state[key].double() + scale * (b.double() @ a.double())
            assert torch.allclose(value.double(), exact, atol=1e-6)
        else:
            assert torch.equal(value, state[key]), key
    # through `rltool train --lora-merge-on-publish`: full HF weights that transformers loads
    result = run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir), num_steps=1,
                             publish=str(tmp_path / "w"), lora_rank=4,
                             lora_merge_on_publish=True, **COMMON))
    model = AutoModelForCausalLM.from_pretrained(result.published, dtype=torch.float32)
    assert (tmp_path / "w" / "weight_v000001" / "model.safetensors").exists()
    trained = load_file(tmp_path / "w" / "weight_v000001" / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(trained[q], base[q])  # the adapter's update is merged in
    assert torch.equal(trained["model.layers.0.input_layernorm.weight"],
                       base["model.layers.0.input_layernorm.weight"])
    assert model.config.vocab_size == backend.vocab_size


def test_cli_lora_flags(tiny_model_dir, train_shard, tmp_path):
    result = CliRunner().invoke(main, [
        "train", "--rollouts", str(train_shard), "--load", str(tiny_model_dir), "--device", "cpu",
        "--num-steps", "1", "--publish", str(tmp_path / "w"), "--lora-rank", "2",
        "--lora-alpha", "4", "--lora-target-modules", "q_proj,v_proj", "--dtype", "bf16",
        "--json"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "w" / "weight_v000001" / lora.CONFIG_FILE).read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["lora_alpha"] == 4
    tensors = load_file(tmp_path / "w" / "weight_v000001" / lora.WEIGHTS_FILE)
    assert len(tensors) == 2 * 2 * 2  # A and B of q_proj and v_proj in the tiny model's 2 layers
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())  # published under --dtype
    bad = CliRunner().invoke(main, [
        "train", "--rollouts", str(train_shard), "--load", str(tiny_model_dir), "--device", "cpu",
        "--num-steps", "1", "--publish", str(tmp_path / "w2"), "--lora-rank", "2",
        "--lora-target-modules", "qproj"])
    assert bad.exit_code == 2 and "qproj: no linear module" in bad.output
    assert not (tmp_path / "w2").exists()


def test_a_peft_adapter_starts_a_run(tiny_model_dir, train_shard, tmp_path):
    """`--load` of an adapter PEFT saved (or a LoRA version rltool published): the base it names
    with that adapter, continued from its version."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(
        LORA_DEFAULT_TARGETS), task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    saved = tmp_path / "weight_v000003"
    peft.save_pretrained(str(saved))
    peft.eval()
    backend = _backend(tiny_model_dir, lora_rank=4)
    backend.load_adapter(saved)
    out = backend.forward_logprobs(MicroBatch([0], TOKENS[:1], STARTS[:1]), temperature=1.0)
    want = _reference_logprobs(peft, TOKENS[0], STARTS[0])
    assert torch.allclose(out.logprobs[0].double(), want, atol=1e-5)
    with pytest.raises(CheckpointError, match="r 4.*have 8.*--lora-rank 4 --lora-alpha 8"):
        _backend(tiny_model_dir, lora_rank=8).load_adapter(saved)
    result = run(TrainConfig(rollouts=[str(train_shard)], load=str(saved), num_steps=1,
                             lora_rank=4, publish=str(tmp_path / "w"), **COMMON))
    assert result.policy_version == 4
    with pytest.raises(ConfigError, match="is a LoRA adapter: train it with --lora-rank"):
        run(TrainConfig(rollouts=[str(train_shard)], load=str(saved), num_steps=1,
                        publish=str(tmp_path / "w2"), **COMMON))
    with pytest.raises(CheckpointError, match="is a LoRA adapter, not full weights"):
        run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir), num_steps=1,
                        old_actor=str(saved), **COMMON))
    assert not (tmp_path / "w2").exists()


def test_a_bad_adapter_directory_is_refused_in_one_line(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    backend = _backend(tiny_model_dir, lora_rank=4)
    good = tmp_path / "good"
    good.mkdir()
    lora.write_adapter(good, tensors=backend.export_adapter(),
                       config=backend.lora.peft_config(tiny_model_dir))
    backend.load_adapter(good)
    renamed, listed, short = tmp_path / "renamed", tmp_path / "listed", tmp_path / "short"
    for directory in (renamed, listed, short):
        directory.mkdir()
        (directory / lora.CONFIG_FILE).write_text((good / lora.CONFIG_FILE).read_text())
    tensors = load_file(good / lora.WEIGHTS_FILE)
    save_file({k.replace("base_model.model.", "x."): v for k, v in tensors.items()},
              str(renamed / lora.WEIGHTS_FILE))
    (listed / lora.CONFIG_FILE).write_text("[]")
    save_file(tensors, str(listed / lora.WEIGHTS_FILE))
    save_file(dict(list(tensors.items())[1:]), str(short / lora.WEIGHTS_FILE))
    for directory, message in ((renamed, "is not named base_model.model."),
                               (listed, "not a JSON object"),
                               (short, "not this model's adapters"),
                               (tmp_path / "missing", "unreadable LoRA adapter")):
        with pytest.raises(CheckpointError, match=message) as err:
            backend.load_adapter(directory)
        assert "\n" not in str(err.value)


def test_the_builtin_engine_serves_the_published_adapter_as_the_trainer_computes(
        tiny_model_dir, tmp_path):
    """The contract between the two sides: a LoRA version the trainer publishes, loaded by the
    engine (`--enable-lora`), gives the trainer's logits (fp32, CPU)."""
    from rltool.engine.paged_runner import PagedRunner

    backend = _backend(tiny_model_dir, lora_rank=4, lora_alpha=12.0)
    _randomize_b(backend)
    published = lora.publish_adapter(tmp_path / "weight_v000001",
                                     tensors=backend.export_adapter(),
                                     config=backend.lora.peft_config(tiny_model_dir))
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=8, page_size=4,
                         max_total_tokens=512, enable_lora=True, max_lora_rank=8)
    runner.lora.load("policy", published)
    runner.use_lora("policy")
    ids = TOKENS[2]
    got = runner.full_pass_logits(ids, start=1)
    backend.inner.eval()
    with torch.no_grad():
        want = backend.inner(input_ids=torch.tensor([ids])).logits[0][:-1]
        with backend.adapters_off():
            base = backend.inner(input_ids=torch.tensor([ids])).logits[0][:-1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(got, base, atol=1e-3)
