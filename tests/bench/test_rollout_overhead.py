"""benchmarks/rollout_overhead.py end to end on the CPU, one small round: every arm (the engine in
process, the HTTP bodies, the rollout stage) generates the same requests' tokens and the record
names each arm's time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.rollout_overhead import VARIANTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_one_round_of_every_arm(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rollout_overhead", "--device", "cpu",
                           "--preset", "tiny", "--rounds", "1", "--prompts", "4", "--samples", "2",
                           "--max-new-tokens", "8", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [written] = tmp_path.iterdir()
    record = json.loads(written.read_text())
    assert written.name.startswith("rollout_overhead-")
    assert set(record["median_s"]) == set(VARIANTS)
    # every arm generated: at most 4 prompts x 2 samples x 8 tokens (an EOS may end one early)
    tokens = record["output_tokens_last_round"]
    assert all(0 < n <= 64 for n in tokens.values()), tokens
