"""`--precision fp8` in the loop: the in-process engine takes the trainer's weights block-quantized
at every step (tensor sync), the versions written at checkpoint steps are `rltool convert fp8` of
the trainer's checkpoint, and every step's metrics record the precision."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rltool.convert.fp8 import Fp8Config, quantize_checkpoint
from rltool.rundir import VERSION_FILE, RunDir, read_metrics
from tests.loop.test_loop_live import loop_cli, loop_config  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def test_fp8_tensor_sync_loop(loop_config, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    proc = loop_cli("--config", str(loop_config), "--run-dir", str(run), "--engine", "inprocess",
                    "--sync", "tensor", "--precision", "fp8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_metrics(RunDir(run).metrics_file("loop"))
    assert [(r["sync/mode"], r["sync/precision"]) for r in rows] == [("tensor", "fp8")] * 2
    version = max(int(p.name.removeprefix("weight_v")) for p in RunDir(run).weights.glob(
        "weight_v*"))
    published = RunDir(run).weight_version(version)
    assert json.loads((published / VERSION_FILE).read_text())["precision"] == "fp8"
    ref = tmp_path / "ref"
    quantize_checkpoint(Fp8Config(hf=RunDir(run).ckpt_step(version) / "model", out=ref,
                                  workers=1))
    got, want = load_file(str(published / "model.safetensors")), {}
    for f in sorted(ref.glob("*.safetensors")):
        want.update(load_file(str(f)))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in got)
