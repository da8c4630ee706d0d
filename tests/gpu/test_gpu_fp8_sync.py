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
