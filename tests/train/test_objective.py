"""rltool.train.objective: a micro-batch's per-sample tensors reach the forward's device in one
copy per dtype, not one blocking copy per tensor and sample."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rltool.train.backend import ForwardOutput, MicroBatch
from rltool.train.config import TrainConfig
from rltool.train.objective import SampleTensors, batch_terms, make_loss_fn, to_device

COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default,
          torch.ops.aten._copy_from.default}
LENGTHS = [5, 3, 7, 4]


class HostToDevice(TorchDispatchMode):
    """Counts the copies from CPU tensors to another device while active."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in COPIES:
            sources = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(t.device.type == "cpu" for t in sources) and out.device.type != "cpu":
                self.copies += 1
        return out


def sample_tensors(*, opd: bool = False, ppo: bool = False) -> SampleTensors:
    g = torch.Generator().manual_seed(0)
    rows = lambda: [-torch.rand(n, generator=g) for n in LENGTHS]
    data = SampleTensors(masks=[(torch.rand(n, generator=g) > 0.2).float() for n in LENGTHS],
                         rollout_logprobs=rows(), old_logprobs=rows(), ref_logprobs=rows(),
                         advantages=[torch.randn(n, generator=g) for n in LENGTHS])
    if opd:
        data.opd_ids = [torch.randint(0, 11, (n, 3), generator=g) for n in LENGTHS]
        data.opd_teacher = [torch.randn(n, 3, generator=g).log_softmax(-1) for n in LENGTHS]
    if ppo:
        data.old_values, data.returns = rows(), rows()
    return data


def loss_fn(cfg: TrainConfig, data: SampleTensors):
    batch = list(range(len(LENGTHS)))
    terms = batch_terms(cfg, data, batch, torch.tensor([0, 0, 1, 1]))
    return make_loss_fn(cfg, data, terms)


def forward(device: str, mb: MicroBatch, **extras) -> ForwardOutput:
    g = torch.Generator().manual_seed(1)
    lp = [-torch.rand(LENGTHS[i], generator=g).to(device) for i in mb.indices]
    return ForwardOutput(logprobs=lp, extras={k: [v(LENGTHS[i]).to(device) for i in mb.indices]
                                              for k, v in extras.items()})


CASES = {
    "grpo+kl+tis": (dict(kl_loss_coef=0.1, ref="unused", tis_mode="truncate"), {}, {}, 1),
    "gspo": (dict(advantage_estimator="gspo"), {}, {}, 1),
    "sft": (dict(loss="sft"), {}, {}, 1),
    "values": (dict(), dict(ppo=True), dict(values=torch.randn), 1),
    # the topk teacher's logprobs (float) and its token ids (int64): one copy per dtype
    "opd-topk": (dict(opd_kl_coef=1.0), dict(opd=True),
                 dict(logits=lambda n: torch.randn(n, 11)), 2),
}


@pytest.mark.parametrize("case", CASES)
def test_one_host_to_device_copy_per_micro_batch_and_dtype(case):
    """Forward outputs on another device (meta: shapes only): the loss of each micro-batch moves
    its samples' tensors in `want` copies, however many samples and tensors it has."""
    options, kinds, extras, want = CASES[case]
    fn = loss_fn(TrainConfig(rollouts=["unused"], load="unused", **options), sample_tensors(**kinds))
    for indices in ([0, 1, 2, 3], [2], [3, 1]):
        mb = MicroBatch(indices, [[0]] * len(indices), [1] * len(indices))
        out = forward("meta", mb, **extras)
        with HostToDevice() as counter:
            loss, metrics = fn(out, mb)
        assert counter.copies == want, (case, indices)
        assert loss.device.type == "meta" and all(m.device.type == "meta"
                                                  for m in metrics.values())


def test_cpu_forward_makes_no_copy_and_uses_the_tensors_as_they_are():
    parts = [torch.arange(3.0), torch.ones(2, 2, dtype=torch.float64), torch.zeros(0)]
    moved = to_device(parts, torch.device("cpu"))
    assert all(a is b for a, b in zip(moved, parts))
    with HostToDevice() as counter:
        fn = loss_fn(TrainConfig(rollouts=["unused"], load="unused"), sample_tensors())
        mb = MicroBatch([0, 2], [[0]] * 2, [1] * 2)
        fn(forward("cpu", mb), mb)
    assert counter.copies == 0


def test_to_device_keeps_order_shapes_and_dtypes():
    parts = [torch.arange(3.0), torch.ones(2, 2, dtype=torch.float64), torch.zeros(0),
             torch.arange(6).view(3, 2), torch.empty(4, device="meta"), torch.ones(1)]
    with HostToDevice() as counter:
        moved = to_device(parts, torch.device("meta"))
    assert counter.copies == 3  # float32, float64, int64; the part already there stays
    assert moved[4] is parts[4]
    assert [(m.device.type, m.shape, m.dtype) for m in moved] == [
        ("meta", p.shape, p.dtype) for p in parts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES)
def test_cuda_loss_matches_the_cpu_loss(case):
    parts = [torch.arange(3.0), torch.ones(2, 2, dtype=torch.float64), torch.arange(6).view(3, 2)]
    assert all(torch.equal(m.cpu(), p) for m, p in zip(to_device(parts, torch.device("cuda")),
                                                       parts))
    options, kinds, extras, _ = CASES[case]
    fn = loss_fn(TrainConfig(rollouts=["unused"], load="unused", **options), sample_tensors(**kinds))
    mb = MicroBatch([3, 0, 2], [[0]] * 3, [1] * 3)
    torch.manual_seed(2)
    want = fn(forward("cpu", mb, **extras), mb)
    torch.manual_seed(2)
    got = fn(forward("cuda", mb, **extras), mb)
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-5, abs=1e-7)
    assert got[1].keys() == want[1].keys()
    for name, value in want[1].items():
        assert got[1][name].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-7), name
