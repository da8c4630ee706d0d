"""benchmarks/engine_long.py (mode long-context of benchmarks/engine_gpu.py) end to end on the CPU:
`--device cpu --quick` through `python -m`, as CI runs it. Checks the record's shape and its
arithmetic, not speed; and that the GPU rows are refused on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="")


def _bench(*args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "benchmarks.engine_gpu", "--mode", "long-context", *args]
    if out is not None:
        cmd += ["--out", str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_quick_cpu_run_writes_one_row_per_context_and_batch(tmp_path):
    proc = _bench("--device", "cpu", "--quick", out=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    [written] = tmp_path.iterdir()
    assert written.name.startswith("engine_gpu-long-context-") and written.name.endswith(".json")
    assert json.loads(written.read_text()) == printed
    assert printed["mode"] == "long-context" and printed["quick"] is True
    assert printed["copy_bandwidth_bytes_per_s"] is None  # no device copy to measure on CPU
    steps = printed["decode_steps"]
    assert steps == 8 and printed["prefill_chunk"] == 128
    rows = printed["rows"]
    assert [(r["preset"], r["context"], r["batch"]) for r in rows] == [("tiny", 256, 2),
                                                                        ("tiny", 512, 2)]
    for r in rows:
        assert r["decode_steps"] == steps
        # Prompts end 2 warm-up steps and the timed steps short of the context.
        assert r["prefill_tokens"] == r["batch"] * (r["context"] - steps - 2)
        assert r["prefill_tokens_per_s"] == pytest.approx(r["prefill_tokens"] / r["prefill_s"])
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["ms_per_step"])
        assert r["batch"] * r["context"] <= r["kv_pool_tokens"] <= r["batch"] * (r["context"]
                                                                                 + 16) + 16
        assert r["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 heads, fp32
        assert r["weight_bytes"] > 0
        for gpu_only in ("gpu_ms_per_step", "roofline_ms_per_step", "roofline_fraction"):
            assert r[gpu_only] is None


def test_cpu_without_quick_is_refused():
    proc = _bench("--device", "cpu")
    assert proc.returncode == 2
    assert "long-context --quick" in proc.stderr and "needs a GPU" in proc.stderr
