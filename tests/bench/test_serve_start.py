"""benchmarks/serve_start.py: the phases read from a server's log, and a `--quick` run end to end
on the CPU (both layouts started, asked and stopped; the record holds every phase)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from benchmarks.serve_start import PHASES, phases

ROOT = Path(__file__).resolve().parents[2]


def stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def test_phases_are_read_from_the_log_lines_against_the_launch():
    launched = datetime(2026, 1, 2, 3, 4, 5).timestamp()
    log = "\n".join([
        f"{stamp(launched + 2.0)} INFO [scheduler] rltool.engine.kv_memory: KV pool: 9 pages",
        f"{stamp(launched + 3.5)} INFO rltool.engine.server: front end loaded (HTTP app, "
        "tokenizer) 3.40 s after the process started",
        f"{stamp(launched + 4.0)} INFO [scheduler] rltool.engine.paged_runner: engine built in "
        "1.25 s: weights (0.00 GiB) 0.10 s, KV pool 0.15 s, 4 decode graphs 0.90 s, warm-up 0.10 s",
        f"{stamp(launched + 4.25)} INFO [scheduler] rltool.engine.server: engine loaded 4.20 s "
        "after its process started (modules imported after 1.75 s)",
        f"{stamp(launched + 4.75)} INFO rltool.engine.server: builtin engine ready at "
        "http://127.0.0.1:1 (pid 7)"])
    got = phases(log, launched)
    assert got == pytest.approx({"imports_s": 1.75, "to_loaded_s": 4.25, "build_s": 1.25,
                                 "to_ready_s": 0.5, "front_end_s": 3.5})
    one_process = "\n".join(line for line in log.splitlines() if "front end" not in line)
    assert phases(one_process, launched)["front_end_s"] is None
    with pytest.raises(RuntimeError, match="lacks its start lines"):
        phases(log.replace("engine loaded", "engine ready"), launched)


@pytest.mark.slow
def test_quick_run_starts_asks_and_stops_both_layouts(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serve_start", "--quick",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    [written] = tmp_path.iterdir()
    record = json.loads(written.read_text())
    assert written.name.startswith("serve_start-") and record["medians"] == printed["medians"]
    assert [r["layout"] for r in record["rounds"]] == ["one", "two"]
    for r in record["rounds"]:
        assert r["exit_code"] == 0
        assert all(r[p] is not None and r[p] >= 0 for p in PHASES if p != "front_end_s")
        assert r["imports_s"] < r["to_loaded_s"] < r["ready_s"]
        assert (r["front_end_s"] is None) == (r["layout"] == "one")
