"""`--precision fp8` in the loop: the in-process engine takes the trainer's weights block-quantized
at every step (tensor sync), the versions written at checkpoint steps are `rltool convert fp8` of
the trainer's checkpoint, and every step's metrics record the precision."""

from __future__ import annotations

import pytest
import torch

from rltool.convert.fp8 import Fp8Config, quantize_checkpoint
from tests.helpers.precision_loop import precision_loop_weights
from tests.loop.test_loop_live import loop_config  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def test_fp8_tensor_sync_loop(loop_config, tmp_path):  # noqa: F811
    got, want = precision_loop_weights(
        loop_config, tmp_path, "fp8",
        lambda hf, out: quantize_checkpoint(Fp8Config(hf=hf, out=out, workers=1)))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in got)
