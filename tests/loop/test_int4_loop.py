"""`--precision int4` in the loop: the in-process engine takes the trainer's weights re-quantized
to INT4 at every step (tensor sync, the codes as stored), the versions written at checkpoint steps
are `rltool convert int4` of the trainer's checkpoint, and every step's metrics record the
precision; the external-engine and broadcast refusals name int4."""

from __future__ import annotations

import pytest
import torch

from rltool.convert.int4 import Int4Config, quantize_checkpoint
from rltool.errors import ConfigError
from rltool.loop.config import LoopSettings
from tests.helpers.precision_loop import precision_loop_weights
from tests.loop.test_config import tables
from tests.loop.test_loop_live import loop_config  # noqa: F401  (fixture)


@pytest.mark.slow
def test_int4_tensor_sync_loop(loop_config, tmp_path):  # noqa: F811
    got, want = precision_loop_weights(
        loop_config, tmp_path, "int4",
        lambda hf, out: quantize_checkpoint(Int4Config(hf=hf, out=out, workers=1)))
    assert got.keys() == want.keys() and any(k.endswith(".weight_packed") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("change,message", [
    ({"sync__sync": "distributed", "sync__precision": "int4", "loop__placement": "colocated"},
     "--precision int4 is not sent over --sync distributed"),
    ({"sync__sync": "auto", "sync__precision": "int4",
      "loop__engine_urls": ["http://127.0.0.1:1"], "loop__num_engines": None},
     "--precision int4 reaches external engines on disk only"),
])
def test_int4_refusals_name_the_precision(tiny_model_dir, change, message):
    with pytest.raises(ConfigError) as err:
        LoopSettings.from_tables(tables(tiny_model_dir, **change))
    assert message in str(err.value) and "\n" not in str(err.value)
