"""The int4 arm of benchmarks/fp8_sync.py on the CPU (tiny model): `[sync] precision = "int4"`
handed over as tensors (quantize_named_int4, the shared-memory buckets) and as a published
version, each step's engine logits equal across the two (the same INT4 weights either way), the
quantization timed apart. Checks the record, not speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_int4_arm_tensor_and_full_agree(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fp8_sync", "--precisions", "bf16",
                           "int4", "--modes", "tensor", "full", "--steps", "1", "--out",
                           str(tmp_path / "sync.json")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "sync.json").read_text()) == printed
    rows = {(r["precision"], r["mode"]): r for r in printed["rows"]}
    assert sorted(rows) == [("bf16", "full"), ("bf16", "tensor"), ("int4", "full"),
                            ("int4", "tensor")]
    assert all(r["modes_agree"] and r["steps"] == 1 and r["step_s"] > 0 for r in rows.values())
    assert rows[("bf16", "tensor")]["quantize_s"] == 0.0
    int4 = rows[("int4", "tensor")]
    assert 0.0 < int4["quantize_s"] < int4["step_s"]
    assert rows[("int4", "full")]["quantize_s"] is None
