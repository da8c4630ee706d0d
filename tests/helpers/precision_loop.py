"""A loop run with `--precision` and tensor sync, its published weights set beside the offline
conversion of the trainer's checkpoint at the same version."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file

from rltool.rundir import VERSION_FILE, RunDir, read_metrics
from tests.loop.test_loop_live import loop_cli


def precision_loop_weights(loop_config: Path, tmp_path: Path, precision: str,
                           convert: Callable[[Path, Path], object]) -> tuple[dict, dict]:
    """Run the in-process loop with tensor sync at `precision`, check its metrics and the
    published version's precision; -> (published tensors, `convert(hf, out)` of the trainer's
    checkpoint at that version)."""
    run = tmp_path / "run"
    proc = loop_cli("--config", str(loop_config), "--run-dir", str(run), "--engine", "inprocess",
                    "--sync", "tensor", "--precision", precision)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_metrics(RunDir(run).metrics_file("loop"))
    assert [(r["sync/mode"], r["sync/precision"]) for r in rows] == [("tensor", precision)] * 2
    version = max(int(p.name.removeprefix("weight_v")) for p in RunDir(run).weights.glob(
        "weight_v*"))
    published = RunDir(run).weight_version(version)
    assert json.loads((published / VERSION_FILE).read_text())["precision"] == precision
    ref = tmp_path / "ref"
    convert(RunDir(run).ckpt_step(version) / "model", ref)
    got, want = load_file(str(published / "model.safetensors")), {}
    for f in sorted(ref.glob("*.safetensors")):
        want.update(load_file(str(f)))
    return got, want
