"""The torch trainer's packed layout on CUDA (bf16 varlen flash attention) against padded."""

from __future__ import annotations

import random

import pytest
import torch

from rltool.train import packed
from rltool.train.backend import MicroBatch
from rltool.train.config import BackendConfig
from rltool.train.torch_backend import TorchBackend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_packed_bf16_on_cuda_matches_padded(tiny_model_factory, arch, monkeypatch):
    assert packed.varlen_attn is not None, "this torch has no varlen_attn: packed runs per sample"
    model_dir = tiny_model_factory(arch)
    rng = random.Random(0)
    tokens = [[rng.randrange(3, 40) for _ in range(rng.randint(5, 60))] for _ in range(6)]
    batch = MicroBatch(list(range(6)), tokens, [3] * 6)
    calls = []
    real = packed.varlen_attn
    monkeypatch.setattr(packed, "varlen_attn", lambda *a, **k: calls.append(1) or real(*a, **k))
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
