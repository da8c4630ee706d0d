"""The INT4 sync benchmarks on the CPU (tiny model), records not speed. The int4 arm of
benchmarks/fp8_sync.py: `[sync] precision = "int4"` handed over as tensors (quantize_named_int4,
the shared-memory buckets) and as a published version, the engine's logits equal across the two
(the same INT4 weights either way), the quantization timed apart. benchmarks/int4_sync.py: the
in-place steps synced as tensors leave the engine computing what a load of the same weights from
disk gives, bf16 and INT4."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def test_int4_arm_tensor_and_full_agree(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fp8_sync", "--precisions", "bf16",
                           "int4", "--modes", "tensor", "full", "--steps", "1", "--out",
                           str(tmp_path / "sync.json")], cwd=ROOT, env=ENV, capture_output=True,
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


def test_int4_sync_tiny_cpu_steps_equal_a_disk_load(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.int4_sync", "--preset", "tiny",
                           "--device", "cpu", "--steps", "2", "--out", str(tmp_path)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    [written] = tmp_path.glob("int4_sync-*-cpu*.json")
    assert json.loads(written.read_text()) == printed
    bf16, int4 = printed["rows"]
    assert (bf16["precision"], int4["precision"]) == ("bf16", "int4")
    assert bf16["equals_disk_load"] and int4["equals_disk_load"]
    assert bf16["quantize_s"] == 0.0 and 0.0 < int4["quantize_s"] < int4["step_s"]
    assert int4["vs_bf16"] == int4["step_s"] / bf16["step_s"]
    assert bf16["bf16_bytes"] == int4["bf16_bytes"] > 0 and bf16["steps"] == 2


def test_int4_sync_refuses_bad_input_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.int4_sync", "--device", "cpu",
                           "--steps", "0"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["Error: --steps must be >= 1, got 0"]
