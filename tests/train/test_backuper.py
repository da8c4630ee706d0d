"""The weight backuper: tiers, spill, prefetch, concurrency, corruption (CPU, tiny models)."""

from __future__ import annotations

import threading

import pytest
import torch

from rltool.errors import CheckpointError
from rltool.train.backuper import (BackuperError, WeightBackuper, fingerprint, module_tensors)
from rltool.train.snapshot_file import MappedSnapshot

pytestmark = pytest.mark.timeout(120)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 24),
                               torch.nn.Linear(24, 50, bias=False).to(torch.bfloat16))


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_bitequal(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    for name, value in module.state_dict().items():
        assert value.dtype == state[name].dtype
        assert torch.equal(value.view(torch.uint8), state[name].view(torch.uint8)), name


def _scramble(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))


@pytest.mark.parametrize("tier", ["host", "ssd", "device-staged", "ssd-staged"])
def test_round_trip_bit_exact_on_every_tier(tmp_path, tier):
    model = _model()
    original = _state(model)
    budget = 0 if tier.startswith("ssd") else None
    with WeightBackuper(module_tensors(model), host_budget_bytes=budget, ssd_dir=tmp_path,
                        stage_on_device=tier.endswith("staged")) as b:
        b.backup("actor")
        assert b.tiers("actor") == {"host" if tier in ("host", "device-staged") else "ssd", "live"}
        _scramble(model, 1)
        b.backup("other")
        if tier.endswith("staged"):
            b.prefetch("actor").result()
            assert "device" in b.tiers("actor")
        b.restore("actor")
        _assert_bitequal(model, original)
        assert "device" not in b.tiers("actor")  # the staged copy is consumed by restore


def test_switch_between_tags_and_copy_and_drop(tmp_path):
    model = _model()
    a = _state(model)
    with WeightBackuper(module_tensors(model), ssd_dir=tmp_path) as b:
        b.backup("actor")
        _scramble(model, 2)
        ref = _state(model)
        b.backup("ref")
        b.copy("actor", "old_actor")
        with b.switched("actor", back="ref"):
            _assert_bitequal(model, a)
        _assert_bitequal(model, ref)
        b.restore("old_actor")
        _assert_bitequal(model, a)
        b.drop("actor")
        assert b.tags == ["old_actor", "ref"]
        with pytest.raises(BackuperError, match="unknown backuper tag 'actor'"):
            b.restore("actor")


def test_spill_and_prefetch_under_a_tiny_budget(tmp_path):
    """Host budget of one snapshot: every new tag spills the least recently used one to SSD,
    prefetch brings a spilled tag back to host (spilling another), and every restore is exact."""
    model = _model()
    b = WeightBackuper(module_tensors(model), ssd_dir=tmp_path, host_budget_bytes=0)
    b.host_budget_bytes = b.snapshot_bytes  # exactly one host copy
    states = {}
    for i, tag in enumerate(["a", "b", "c"]):
        _scramble(model, 10 + i)
        states[tag] = _state(model)
        b.backup(tag)
        assert b.host_bytes <= b.host_budget_bytes
    assert b.tiers("c") == {"host", "live"}
    assert b.tiers("a") == {"ssd"} and b.tiers("b") == {"ssd"}
    b.prefetch("a").result()
    assert "host" in b.tiers("a") and "host" not in b.tiers("c") and "ssd" in b.tiers("c")
    assert b.host_bytes <= b.host_budget_bytes
    for tag in ["b", "a", "c", "a"]:
        b.restore(tag)
        _assert_bitequal(model, states[tag])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["a.safetensors", "b.safetensors", "c.safetensors"]
    b.spill("a")  # its file is current: only the host copy goes
    assert b.tiers("a") == {"ssd", "live"} and b.host_bytes == 0
    b.restore("b")
    _assert_bitequal(model, states["b"])
    b.close()
    assert not any(tmp_path.iterdir())  # drop removes the files of a caller's directory


def test_concurrent_prefetch_and_restore_of_the_same_tag(tmp_path):
    """restore racing prefetch of one tag (and another thread prefetching it again) always
    yields the exact snapshot: the tag lock serialises them."""
    model = _model()
    b = WeightBackuper(module_tensors(model), ssd_dir=tmp_path, host_budget_bytes=0,
                       stage_on_device=True)
    b.backup("x")
    x = _state(model)
    _scramble(model, 5)
    b.backup("y")
    y = _state(model)
    errors = []

    def hammer():
        try:
            for _ in range(20):
                b.prefetch("x")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    for _ in range(15):
        thread = threading.Thread(target=hammer)
        thread.start()
        b.prefetch("x")
        b.restore("x")
        _assert_bitequal(model, x)
        b.restore("y")
        _assert_bitequal(model, y)
        thread.join()
    assert not errors
    b.close()


def test_corrupt_ssd_snapshot_is_refused_and_live_weights_untouched(tmp_path):
    model = _model()
    b = WeightBackuper(module_tensors(model), ssd_dir=tmp_path, host_budget_bytes=0)
    b.backup("ref")
    _scramble(model, 3)
    live = _state(model)
    path = tmp_path / "ref.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # one flipped bit in the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        b.restore("ref")
    _assert_bitequal(model, live)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        MappedSnapshot(path)
    path.write_bytes(bytes(data[:-8]))  # truncated
    with pytest.raises(CheckpointError):
        b.restore("ref")
    b.close()


def test_single_tag_mode_copies_nothing_and_verifies(tmp_path):
    model = _model()
    b = WeightBackuper(module_tensors(model), single_tag="actor", ssd_dir=tmp_path)
    b.backup("actor")
    assert b.host_bytes == 0 and not any(tmp_path.iterdir())
    b.restore("actor")  # unchanged: a no-op that passes the check
    with torch.no_grad():
        next(model.parameters()).view(-1)[7] += 1.0
    with pytest.raises(BackuperError, match="live weights changed"):
        b.restore("actor")
    b.backup("actor")
    b.restore("actor")
    with pytest.raises(BackuperError, match="single-tag mode holds only 'actor'"):
        b.backup("ref")
    b.close()


def test_fingerprint_sees_a_swap():
    t = torch.arange(8, dtype=torch.float32)
    s = t.clone()
    s[[0, 1]] = s[[1, 0]]
    assert fingerprint([t]) != fingerprint([s]) and fingerprint([t]) == fingerprint([t.clone()])


def test_load_dir_matches_transformers_and_refuses_other_architectures(tiny_model_factory,
                                                                      tmp_path):
    from transformers import AutoModelForCausalLM

    ref_dir = tiny_model_factory("qwen2", seed=1)
    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_factory("qwen2", seed=0)),
                                                  dtype=torch.float32)
    expected = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
    before = _state(policy)
    with WeightBackuper(module_tensors(policy), ssd_dir=tmp_path) as b:
        b.backup("actor")
        b.load_dir("ref", ref_dir)
        _assert_bitequal(policy, before)  # adding a tag does not touch the live weights
        with b.switched("ref", back="actor"):
            _assert_bitequal(policy, _state(expected))
        _assert_bitequal(policy, before)
        with pytest.raises(CheckpointError, match="do not match the live model"):
            b.load_dir("other", tiny_model_factory("llama", seed=0))
        with pytest.raises(Exception, match="bad backuper tag"):
            b.backup("../escape")


@pytest.mark.gpu
def test_pinned_transfers_round_trip_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _model().cuda()
    original = _state(model)
    with WeightBackuper(module_tensors(model), ssd_dir=tmp_path) as b:
        assert b.pin_memory and b.stage_on_device
        b.backup("actor")
        assert b._tags["actor"].host.is_pinned()
        _scramble(model, 1)
        b.backup("other")
        b.restore("actor")
        _assert_bitequal(model, original)
        b.prefetch("other").result()
        assert "device" in b.tiers("other")
        f = fingerprint(module_tensors(model).values())
        assert f == fingerprint(module_tensors(model).values())


@pytest.mark.gpu
def test_prefetch_overlaps_compute_on_cuda(tmp_path):
    """A prefetch of a host tag runs on a side stream while the main stream computes: it is
    staged on the device (and its copies done) while the main stream's work is still queued,
    and the restore then takes the staged copy. Checked by stream state, not by timing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    big = torch.nn.Linear(8192, 8192).cuda()  # 256 MiB of fp32 weights
    with WeightBackuper(module_tensors(big), ssd_dir=tmp_path) as b:
        b.backup("a")
        _scramble(big, 1)
        b.backup("b")
        want = _state(big)
        b.restore("a")
        torch.cuda.synchronize()
        x = torch.randn(8192, 8192, device="cuda")
        gate = torch.cuda.Event()
        for _ in range(40):  # ~45 TFLOP queued on the main stream
            x = torch.tanh(x @ x)
        gate.record()
        b.prefetch("b").result()
        assert not gate.query(), "the prefetch waited for the main stream's work"
        assert "device" in b.tiers("b")
        b.restore("b")
        _assert_bitequal(big, want)


# -- wired into the train stage --------------------------------------------------------------
def _frozen_logprobs(model_dir, cfg, sample_set, plan):
    from rltool.train.step import compute_logprobs
    from rltool.train.torch_backend import TorchBackend

    frozen = TorchBackend(model_dir, options=cfg, trainable=False)
    return compute_logprobs(frozen, sample_set.samples,
                            [plan.batch(k) for k in range(plan.steps_per_epoch)],
                            temperature=sample_set.temperature,
                            max_tokens_per_microbatch=cfg.max_tokens_per_microbatch)["logprobs"]


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])
def test_stage_ref_and_old_actor_come_from_snapshots(tiny_model_factory, train_shard, tmp_path,
                                                     estimator):
    """--ref and --old-actor logprobs computed by switching snapshots into the policy model equal
    those of separate frozen models bit for bit, and the policy's weights (and value head) come
    back exactly, also when every snapshot spills to SSD (budget 0)."""
    from rltool.train.config import TrainConfig
    from rltool.train.stage import preflight
    from rltool.train.step import prepare_set, role_snapshots
    from rltool.train.torch_backend import TorchBackend

    policy, ref, old = (tiny_model_factory("qwen2", seed=s) for s in (0, 1, 2))
    cfg = TrainConfig(rollouts=[str(train_shard)], load=str(policy), ref=str(ref),
                      old_actor=str(old), kl_loss_coef=0.1, advantage_estimator=estimator,
                      max_tokens_per_microbatch=40, global_batch_size=6,
                      backuper_host_budget_gb=0.0, backuper_dir=str(tmp_path / "snap"))
    checked = preflight(cfg)
    backend = TorchBackend(policy, options=cfg, value_head=cfg.value_head)
    expected_values = None
    if estimator == "ppo":  # a non-zero head, so values tell which trunk computed them
        from rltool.train.step import compute_logprobs

        _scramble(backend.inner.value_head, 7)
        expected_values = compute_logprobs(
            backend, checked.sample_set.samples,
            [checked.plan.batch(k) for k in range(checked.plan.steps_per_epoch)],
            temperature=checked.sample_set.temperature, max_tokens_per_microbatch=40,
            with_values=True)["values"]
    before = _state(backend.inner)
    snapshots = role_snapshots(cfg, backend, ref_dir=checked.ref_target.model_dir,
                               old_actor_dir=checked.old_actor_target.model_dir)
    try:
        assert snapshots.tiers("ref") == {"ssd"}
        data, timings = prepare_set(cfg, backend, snapshots, checked.sample_set, checked.plan)
    finally:
        snapshots.close()
    assert not (tmp_path / "snap").exists() or not any((tmp_path / "snap").iterdir())
    _assert_bitequal(backend.inner, before)
    args = (cfg, checked.sample_set, checked.plan)
    for got, want in ((data.ref_logprobs, _frozen_logprobs(ref, *args)),
                      (data.old_logprobs, _frozen_logprobs(old, *args))):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert "perf/weight_switch_time" in timings
    if expected_values is not None:  # values come from the current weights, not the old actor
        assert all(torch.equal(g, w) for g, w in zip(data.old_values, expected_values,
                                                     strict=True))


def test_old_actor_refused_with_bypass(tiny_model_dir, train_shard):
    from rltool.errors import ConfigError
    from rltool.train.config import TrainConfig

    with pytest.raises(ConfigError, match="--old-actor"):
        TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir),
                    old_actor=str(tiny_model_dir), bypass=True)


def test_backuper_dir_that_is_a_file_is_refused_up_front(tiny_model_dir, train_shard, tmp_path):
    from rltool.errors import ConfigError
    from rltool.train.config import TrainConfig
    from rltool.train.stage import preflight

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="--backuper-dir"):
        preflight(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir),
                              backuper_dir=str(tmp_path / "file")))
