"""The torch trainer's packed layout on CUDA (bf16 varlen flash attention) against padded."""

from __future__ import annotations

import random

import pytest
import torch

from rltool import varlen
from rltool.train.backend import MicroBatch
from rltool.train.config import BackendConfig
from rltool.train.torch_backend import TorchBackend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_packed_bf16_on_cuda_matches_padded(tiny_model_factory, arch, monkeypatch):
    assert varlen.available(), "this torch has no varlen_attn: packed runs per sample"
    model_dir = tiny_model_factory(arch)
    rng = random.Random(0)
    tokens = [[rng.randrange(3, 40) for _ in range(rng.randint(5, 60))] for _ in range(6)]
    batch = MicroBatch(list(range(6)), tokens, [3] * 6)
    calls = []
    real, args = varlen.kernel()
    monkeypatch.setattr(varlen, "kernel",
                        lambda: (lambda *a, **k: calls.append(1) or real(*a, **k), args))
    outs = {}
    for layout in ("padded", "packed"):
        backend = TorchBackend(model_dir, options=BackendConfig(
            micro_batch_layout=layout, dtype="bf16", device="cuda"))
        assert backend.packed == (layout == "packed")
        outs[layout] = backend.forward_logprobs(batch, temperature=1.0)
    for x, y in zip(outs["padded"].logprobs, outs["packed"].logprobs):
        torch.testing.assert_close(y, x, atol=2e-2, rtol=0)
    assert calls  # the flash varlen kernel ran (not the per-sample fallback)
    assert TorchBackend(model_dir, options=BackendConfig(device="cuda")).packed  # auto


def test_offload_releases_device_memory_and_reload_restores_bits(tiny_model_dir):
    from rltool.train.offload import Offloader

    backend = TorchBackend(tiny_model_dir, options=BackendConfig(device="cuda", lr=1e-3))
    batch = MicroBatch([0, 1], [[5, 6, 7, 8, 9], [4, 3, 2]], [2, 1])
    backend.train_step([batch], lambda out, mb: (sum(lp.sum() for lp in out.logprobs), {}),
                       temperature=1.0)
    before = {k: v.clone() for k, v in backend.inner.state_dict().items()}
    moments = [v.clone() for st in backend.optimizer.state.values() for k, v in st.items()
               if k != "step"]
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    offloader = Offloader(backend.inner, backend.optimizer)
    move = offloader.offload()
    assert move.device_allocated_after <= loaded - 0.95 * move.bytes
    assert all(p.device.type == "cpu" and p.is_pinned() for p in backend.inner.parameters())
    offloader.reload()
    assert torch.cuda.memory_allocated() >= loaded - 4096
    after = backend.inner.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].is_cuda for k in before)
    again = [v for st in backend.optimizer.state.values() for k, v in st.items() if k != "step"]
    assert all(torch.equal(a, b) for a, b in zip(moments, again))
