"""The benchmarks' harness, through `python -m benchmarks.trace_overhead` (the quickest script):
the record it writes under `--out DIR` is named NAME-DATE-DEVICE.json, carries the machine and
the load averages, and equals the one JSON line that ends stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_record_is_written_as_name_date_device_and_printed_last(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    days = {datetime.now(timezone.utc).strftime("%Y-%m-%d")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.trace_overhead", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    [written] = tmp_path.iterdir()
    days.add(datetime.now(timezone.utc).strftime("%Y-%m-%d"))  # a run across midnight
    assert written.name in {f"trace_overhead-{day}-cpu{os.cpu_count()}.json" for day in days}
    assert json.loads(written.read_text()) == printed
    assert printed["benchmark"] == "trace_overhead" and printed["device"] == "cpu"
    assert printed["machine"]["cores"] == os.cpu_count() and printed["machine"]["gpu"] is None
    assert printed["machine"]["torch"] and printed["machine"]["python"]
    assert len(printed["load_avg_before"]) == 3 and len(printed["load_avg_after"]) == 3
    assert printed["on_us"] > 0 and printed["off_us"] > 0
