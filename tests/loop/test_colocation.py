"""Who holds the device in the colocated loop (rltool.loop.colocation), and `[loop] device`.

The alternation itself runs on CUDA (tests/gpu/test_gpu_loop.py); here its bookkeeping runs with
the CPU Offloader: the order of engine calls and trainer moves, bit-exact round trips, and the
weights staged for the engines."""

from __future__ import annotations

import pytest
import torch

from rltool.errors import ConfigError
from rltool.loop.config import LoopSettings
from rltool.loop import colocation
from rltool.loop.colocation import Residency
from rltool.rundir import RunDir
from rltool.train.config import TrainConfig
from rltool.train.resident import ResidentTrainer
from tests.loop.test_config import tables


class Engines:
    """Records the memory calls the loop makes of its engines."""

    device = "cpu"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def release_memory(self) -> None:
        self.calls.append("release")

    def resume_memory(self) -> None:
        self.calls.append("resume")


def trained(model_dir) -> ResidentTrainer:
    """A resident trainer with gradients and Adam state (one step on a made-up loss)."""
    trainer = ResidentTrainer(TrainConfig(load=str(model_dir), rollouts=["unused"],
                                          device="cpu", lr=1e-3))
    inner, opt = trainer.backend.inner, trainer.backend.optimizer
    sum(p.float().square().sum() for p in inner.parameters()).backward()
    opt.step()
    return trainer


def state_of(trainer: ResidentTrainer) -> dict[str, torch.Tensor]:
    inner, opt = trainer.backend.inner, trainer.backend.optimizer
    out = {f"p.{n}": p.data.clone() for n, p in inner.named_parameters()}
    for i, st in enumerate(opt.state.values()):
        out.update({f"o{i}.{k}": v.clone() for k, v in st.items() if v.dim() > 0})
    return out


def on_a_device(monkeypatch, *, device_gib: float, host_gib: float) -> None:
    """The device's and the host's memory as the offload plan sees them."""
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda *a: (0, int(device_gib * 2**30)))
    monkeypatch.setattr(colocation, "host_available", lambda: int(host_gib * 2**30))


def test_alternation_order_and_bit_exact_round_trips(tiny_model_dir, monkeypatch):
    settings = LoopSettings.from_tables(tables(tiny_model_dir, sync__sync="tensor"))
    engines = Engines()
    res = Residency(settings, engines, resident=True, disk_sync=False)
    assert not res.alternate  # the CPU: nothing alternates, nothing is released
    res.alternate = True  # the CUDA bookkeeping, exercised with the CPU Offloader
    on_a_device(monkeypatch, device_gib=80, host_gib=64)
    trainer = trained(tiny_model_dir)
    before = state_of(trainer)
    res.for_engines(trainer)  # rollout: the trainer moves off, the engines were never released
    assert trainer.offloaded and engines.calls == [] and res.plan.offload == "all"
    assert all(p.grad is None for p in trainer.backend.inner.parameters())  # freed, not moved
    res.before_trainer(training=True)  # train: engines release first, then the trainer reloads
    res.before_trainer(training=True)  # idempotent
    res.reload_trainer(trainer)
    assert engines.calls == ["release"] and not trainer.offloaded
    after = state_of(trainer)
    assert before.keys() == after.keys() and len(after) > 3 * len(list(
        trainer.backend.inner.parameters())) - 1  # parameters and both Adam moments
    assert all(torch.equal(before[k], after[k]) for k in before)
    staged = res.engine_weights(trainer, torch.bfloat16)  # sync: stage, offload, resume
    assert engines.calls == ["release", "resume"] and trainer.offloaded
    own = dict(trainer.named_tensors())
    assert [n for n, _ in staged] == sorted(own)
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, own[n].to(torch.bfloat16))
               for n, t in staged)
    assert set(res.seconds) == {"trainer_offload", "trainer_reload", "engine_release",
                                "engine_resume", "stage_weights"}
    res.for_engines(trainer)  # eval after sync: nothing left to move
    assert engines.calls == ["release", "resume"]


def test_disk_sync_releases_only_to_train(tiny_model_dir):
    settings = LoopSettings.from_tables(tables(tiny_model_dir))
    engines = Engines()
    res = Residency(settings, engines, resident=True, disk_sync=True)
    res.before_trainer(training=False)  # building the trainer to publish: engines keep memory
    assert engines.calls == []
    res.before_trainer(training=True)
    res.for_engines(None)
    res.for_engines(None)
    assert engines.calls == ["release", "resume"]


def test_loop_device_reaches_engines_and_trainer(tiny_model_dir, tmp_path):
    run = RunDir(tmp_path / "run")
    s = LoopSettings.from_tables(tables(tiny_model_dir, loop__device="cpu"))
    assert s.device == "cpu" and s.engine_args()[-2:] == ["--device", "cpu"]
    t = s.train_config(run, step=0, load="x")
    assert t.device == "cpu" and t.dtype == "fp32"
    # Their own settings win.
    s = LoopSettings.from_tables(tables(tiny_model_dir, loop__device="cpu",
                                        loop__engine_args=["--device", "auto"],
                                        train__dtype="bf16"))
    assert s.engine_args() == ["--device", "auto"]
    assert s.train_config(run, step=0, load="x").dtype == "bf16"
    s = LoopSettings.from_tables(tables(tiny_model_dir, loop__engine="inprocess",
                                        sync__sync="tensor"))
    assert s.serve_config(tiny_model_dir).engine_device == s.device
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"\[loop\] device: --device cuda: torch sees no "
                           "CUDA GPU"):
            LoopSettings.from_tables(tables(tiny_model_dir, loop__device="cuda"))


def test_optimizer_offload_keeps_the_parameters_and_auto_picks_it_when_the_host_is_short(
        tiny_model_dir, monkeypatch, caplog):
    settings = LoopSettings.from_tables(tables(tiny_model_dir, sync__sync="tensor"))
    res = Residency(settings, Engines(), resident=True, disk_sync=False)
    res.alternate = True
    trainer = trained(tiny_model_dir)
    inner, opt = trainer.backend.inner, trainer.backend.optimizer
    n = sum(p.numel() for p in inner.parameters())
    # Room for the optimizer state and the staged bf16 weights (10 bytes a parameter), not for
    # the parameters as well (14): auto keeps them on the device.
    on_a_device(monkeypatch, device_gib=80, host_gib=12 * n / 0.75 / 2**30)
    before = state_of(trainer)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in inner.parameters())
    params = {name: p.data_ptr() for name, p in inner.named_parameters()}
    with caplog.at_level("INFO", logger="rltool.loop.colocation"):
        res.offload_trainer(trainer)
    assert res.plan.offload == "optimizer" and res.plan.host["optimizer"] == 8 * n
    assert "trainer offloaded (optimizer): optimizer" in caplog.text and "params" not in \
        caplog.text.split("trainer offloaded")[1]
    assert all(p.data_ptr() == params[name] for name, p in inner.named_parameters())
    res.reload_trainer(trainer)
    for p in inner.parameters():  # gradients again, as a step leaves them
        p.grad = torch.ones_like(p)
    move = trainer.offload()
    assert move.moved == {"optimizer": 2 * grads} and move.grads_freed == grads
    assert all(p.grad is None for p in inner.parameters())
    moments = [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    assert len(moments) == 2 * len(params)
    res.reload_trainer(trainer)
    after = state_of(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    res.offload_trainer(trainer)
    with pytest.raises(RuntimeError, match="while the trainer is loaded"):
        trainer.keep_params(False)


def test_a_plan_that_does_not_fit_stops_with_the_knob_to_turn(tiny_model_dir, monkeypatch):
    settings = LoopSettings.from_tables(tables(tiny_model_dir, sync__sync="tensor",
                                               loop__offload="all"))
    res = Residency(settings, Engines(), resident=True, disk_sync=False)
    res.alternate = True
    trainer = trained(tiny_model_dir)
    on_a_device(monkeypatch, device_gib=80, host_gib=1e-4)
    with pytest.raises(ConfigError, match=r"offload all needs .* pinned host memory.*\[loop\] "
                       "offload = optimizer"):
        res.offload_trainer(trainer)
    assert not trainer.offloaded


def test_a_model_the_plan_does_not_cover_offloads_as_set(tiny_model_dir, monkeypatch):
    on_a_device(monkeypatch, device_gib=80, host_gib=64)
    for offload in ("auto", "optimizer"):
        settings = LoopSettings.from_tables(tables(tiny_model_dir, sync__sync="tensor",
                                                   loop__offload=offload))
        res = Residency(settings, Engines(), resident=True, disk_sync=False)
        res.alternate = True
        trainer = trained(tiny_model_dir)
        trainer.backend.config.model_type = "qwen3_moe"
        if offload == "auto":
            with pytest.raises(ConfigError, match="covers dense models"):
                res.offload_trainer(trainer)
            continue
        res.offload_trainer(trainer)
        assert res.plan is None and res.policy == "optimizer" and trainer.offloaded
        assert not trainer._offloader.params  # the parameters stay


def test_offload_none_keeps_both_and_hands_over_the_trainers_own_tensors(tiny_model_dir,
                                                                         monkeypatch):
    settings = LoopSettings.from_tables(tables(tiny_model_dir, sync__sync="tensor",
                                               loop__offload="none"))
    engines = Engines()
    res = Residency(settings, engines, resident=True, disk_sync=False)
    res.together = True  # the CUDA mode, exercised on the CPU
    trainer = trained(tiny_model_dir)
    on_a_device(monkeypatch, device_gib=80, host_gib=1e-4)  # the host needs nothing
    res.for_engines(trainer)
    res.before_trainer(training=True)
    named = res.engine_weights(trainer, torch.bfloat16)
    assert engines.calls == [] and not trainer.offloaded and res.plan.offload == "none"
    assert res.plan.host == {} and res.plan.peak("train") > res.plan.peak("rollout")
    params = {p.data_ptr() for p in trainer.backend.inner.parameters()}
    assert named and all(t.dtype == torch.float32 for _, t in named)
    assert any(t.data_ptr() in params for _, t in named)  # the trainer's own, not host copies
    res.plan = None  # a device with room for 8 bytes a parameter besides the reserve: too small
    n = sum(p.numel() for p in trainer.backend.inner.parameters())
    on_a_device(monkeypatch, device_gib=2 + 8 * n / 2**30, host_gib=64)
    with pytest.raises(ConfigError, match=r"offload none keeps .* \[loop\] offload = auto"):
        res.engine_weights(trainer, torch.bfloat16)

