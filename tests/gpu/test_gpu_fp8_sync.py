"""`[sync] precision = "fp8"` into a CUDA engine whose linears stay FP8: block-FP8 weights handed
over in memory (e4m3 + scales, 128x128 blocks) leave it serving exactly what it serves after
loading `rltool convert fp8` of the same weights from disk.

Skips only when `torch.cuda.is_available()` is false."""

from __future__ import annotations

import pytest
import torch

from rltool.delta import tensor_sync
from rltool.delta.publish import FP8_BLOCK
from rltool.engine.paged_runner import PagedRunner
from tests.delta.test_fp8_sync import SEQ, setup  # noqa: F401  (fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_tensor_sync_into_fp8_resident_engine(setup):  # noqa: F811
    base, states, refs = setup

    def engine() -> PagedRunner:
        return PagedRunner(refs[2], device="cuda", dtype="bf16", max_running=2, page_size=4,
                           max_total_tokens=64)

    from_disk, in_memory = engine(), engine()
    assert in_memory.weight_info["weight_dtype"] == "fp8_e4m3"  # linears stay FP8
    from_disk.load_weights(refs[1])
    named = tensor_sync.quantize_named(list(states[1].items()), dtype=torch.bfloat16,
                                       block=FP8_BLOCK)
    in_memory.load_named_tensors(named, block=FP8_BLOCK)
    assert torch.equal(in_memory.full_pass_logits(SEQ, start=1),
                       from_disk.full_pass_logits(SEQ, start=1))


def test_device_quantization_gives_the_host_kernels_bytes(setup):  # noqa: F811
    """`quantize_named` of CUDA tensors quantizes on the GPU (the loop's colocated FP8 sync) and
    gives the bytes the host's native kernel gives for the same tensors, scales included; so does
    a weight of the 0.5B shapes with an outlier and a ragged last block."""
    from rltool.convert.fp8 import quantize_blocks

    _, states, _ = setup
    named = list(states[1].items())
    host = tensor_sync.quantize_named(named, dtype=torch.bfloat16, block=FP8_BLOCK)
    device = tensor_sync.quantize_named([(n, t.cuda()) for n, t in named],
                                        dtype=torch.bfloat16, block=FP8_BLOCK)
    assert [n for n, _ in device] == [n for n, _ in host]

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    assert all(d.device.type == "cuda" and torch.equal(raw(h), raw(d.cpu()))
               for (_, h), (_, d) in zip(host, device))
    w = torch.randn(4864, 900, generator=torch.Generator().manual_seed(0)) * 0.02
    w[7, 5] = 4.0
    w = w.to(torch.bfloat16)
    q_host, s_host = quantize_blocks(w, FP8_BLOCK)
    q_dev, s_dev = quantize_blocks(w.cuda(), FP8_BLOCK)
    assert torch.equal(raw(q_host), raw(q_dev.cpu())) and torch.equal(s_host, s_dev.cpu())
