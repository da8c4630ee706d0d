"""The resident trainer (the colocated loop's): after every set it saves, a trainer reloaded from
that checkpoint holds the same weights, optimizer state, schedule position and RNG bit for bit,
and trains the next set to the same weights as the resident one."""

from __future__ import annotations

import pytest
import torch

from rltool.train.config import TrainConfig
from rltool.train.resident import ResidentTrainer
from tests.helpers.shards import REWARDS, make_shard, shard_rows

pytestmark = pytest.mark.timeout(300)
COMMON = dict(lr=1e-2, global_batch_size=4, num_epochs=2, lr_warmup_steps=2, shuffle=True,
              deterministic=True, seed=5, entropy_coef=0.01)


def state_of(trainer: ResidentTrainer) -> dict[str, torch.Tensor]:
    """Every tensor of the trainer's state: weights, optimizer moments, RNG."""
    backend = trainer.backend
    out = {f"model/{k}": v for k, v in backend.model.state_dict().items()}
    for i, (pid, st) in enumerate(sorted(backend.optimizer.state_dict()["state"].items())):
        for k, v in st.items():
            out[f"optim/{pid}/{k}"] = torch.as_tensor(v)
    out["rng"] = trainer._rng
    return out


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]


def test_resident_state_equals_a_reload_of_its_checkpoint_at_every_save(tiny_model_dir, tmp_path):
    shards = [make_shard(tmp_path / "rollouts" / f"step-{s:06d}", tiny_model_dir,
                         shard_rows(REWARDS, seed=s), step=s) for s in range(3)]
    save = tmp_path / "ckpt"

    def cfg(step: int, load: str) -> TrainConfig:
        return TrainConfig(rollouts=[str(shards[step])], load=load, **COMMON)

    resident = ResidentTrainer(cfg(0, str(tiny_model_dir)))
    ahead = None  # a reload of the previous checkpoint, trained on this step's set
    for step in range(3):
        resident.train(cfg(step, str(tiny_model_dir)), loop_step=step, log_metrics=False)
        if ahead is not None:
            assert_bit_equal(state_of(resident), state_of(ahead))
        torch.rand(7)  # the loop's process draws from torch's RNG between steps
        ckpt = resident.save(save)
        reloaded = ResidentTrainer(cfg(step, str(ckpt)))
        assert (reloaded.version, reloaded.loop_step) == (resident.version, step)
        assert reloaded.backend.optimizer_steps == resident.backend.optimizer_steps
        assert_bit_equal(state_of(resident), state_of(reloaded))
        if step < 2:
            reloaded.train(cfg(step + 1, str(ckpt)), loop_step=step + 1, log_metrics=False)
            ahead = reloaded
    assert resident.version == 3 * 6  # 3 sets x 2 epochs x 12 samples / batches of 4


def test_offload_and_reload_between_sets_change_nothing(tiny_model_dir, tmp_path):
    """The residency bookkeeping of a colocated GPU loop, run on CPU: parameters and optimizer
    moments go to reused host buffers and come back bit-exact, gradients are freed, and training
    on after each round trip gives the state of a trainer that never left."""
    shards = [make_shard(tmp_path / "rollouts" / f"step-{s:06d}", tiny_model_dir,
                         shard_rows(REWARDS, seed=s), step=s) for s in range(2)]

    def cfg(step: int) -> TrainConfig:
        return TrainConfig(rollouts=[str(shards[step])], load=str(tiny_model_dir), **COMMON)

    stays, moves = ResidentTrainer(cfg(0)), ResidentTrainer(cfg(0))
    buffers = None
    for step in range(2):
        for trainer in (stays, moves):
            trainer.train(cfg(step), loop_step=step, log_metrics=False)
        before = state_of(moves)
        move = moves.offload()
        offloader = moves._offloader
        params = dict(moves.backend.inner.named_parameters())
        # every parameter and Adam moment now lives in the offloader's host buffers
        assert all(params[n].data.data_ptr() == buf.data_ptr()
                   for (n, kind), buf in offloader._host.items() if kind == "param")
        moments = sum(1 for _, kind in offloader._host if kind.startswith("opt."))
        assert moments == 2 * len(params) and move.tensors == len(offloader._host)
        assert move.bytes == sum(b.numel() * b.element_size() for b in offloader._host.values())
        assert move.moved["params"] == sum(p.numel() * 4 for p in params.values())
        assert all(p.grad is None for p in params.values())  # gradients: never moved
        with pytest.raises(RuntimeError, match="twice"):
            moves.offload()
        ptrs = {k: b.data_ptr() for k, b in offloader._host.items()}
        assert buffers is None or ptrs == buffers  # allocated once, reused by the next offload
        buffers = ptrs
        moves.reload()
        assert all(p.data.data_ptr() not in ptrs.values() for p in params.values())
        assert_bit_equal(before, state_of(moves))
    assert_bit_equal(state_of(stays), state_of(moves))


def test_first_step_forward_gives_its_batch_old_logprobs_bit_for_bit(tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    """On the CPU the first optimizer step's forward gives its batch's old logprobs (one no-grad
    pass fewer per set): weights, optimizer state, old logprobs and metrics equal a trainer that
    runs the separate pass, over two sets of two epochs."""
    import rltool.train.step as train_step
    from rltool.train.torch_backend import TorchBackend

    shards = [make_shard(tmp_path / "rollouts" / f"step-{s:06d}", tiny_model_dir,
                         shard_rows(REWARDS, seed=s), step=s) for s in range(2)]
    common = dict(COMMON, deterministic=False, device="cpu")

    def cfg(step: int) -> TrainConfig:
        return TrainConfig(rollouts=[str(shards[step])], load=str(tiny_model_dir), **common)

    passes = []
    real = TorchBackend.forward_logprobs
    monkeypatch.setattr(TorchBackend, "forward_logprobs",
                        lambda self, mb, **kw: passes.append(len(mb.indices)) or real(self, mb, **kw))
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(train_step, "old_from_forward", lambda *a, **k: False)
        trainer, rows = ResidentTrainer(cfg(0)), []
        passes.clear()
        for step in range(2):
            rows += trainer.train(cfg(step), loop_step=step, log_metrics=False)
        runs.append((trainer, rows, list(passes), trainer._last[0].old_logprobs))
    (a, rows_a, passes_a, old_a), (b, rows_b, passes_b, old_b) = runs
    assert sum(passes_a) == sum(passes_b) - 2 * 4  # one batch of 4 per set from the step
    assert_bit_equal(state_of(a), state_of(b))
    assert all(torch.equal(x, y) for x, y in zip(old_a, old_b))
    drop = ("time", "perf/train_time", "perf/log_probs_time")
    assert [{k: v for k, v in r.items() if k not in drop} for r in rows_a] == \
        [{k: v for k, v in r.items() if k not in drop} for r in rows_b]
