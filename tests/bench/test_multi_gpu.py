"""`python -m benchmarks.multi_gpu` on the CPU (gloo, tiny models): the megatron-layout and
distributed-sync runs end to end, each checked through the JSON it writes. The numbers are checks
of the code paths (TP2 logprobs against TP1; every sync method serving the same new weights), not
performance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(item: str, out: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.multi_gpu", item, "--device", "cpu",
                           "--out", str(out), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    record = json.loads(Path(paths[item]).read_text())
    assert record["device"] == "cpu" and record["gpus"] == 2 and record["date"]
    assert record["machine"] and Path(paths[item]).name.startswith(f"multi_gpu-{item}-")
    return record


@pytest.mark.slow
def test_megatron_layout_matches_tp1_over_gloo(tmp_path):
    record = run("megatron", tmp_path, "--layouts", "tp2,tp2pp2", "--samples", "4",
                 "--min-len", "6", "--max-len", "16", "--seq-len", "64", "--steps", "1",
                 "--warmup", "0")
    rows = {r["layout"]: r for r in record["results"]}
    assert set(rows) == {"tp1", "tp2", "tp2pp2"}
    assert rows["tp1"]["fp32_max_abs_diff"] == 0.0 and rows["tp1"]["ranks"] == 1
    tp2 = rows["tp2"]
    assert "error" not in tp2, tp2.get("error")
    assert tp2["ranks"] == 2 and tp2["fp32_check"] is True
    assert 0.0 <= tp2["fp32_max_abs_diff"] <= record["fp32_bound"]
    assert tp2["tokens_per_s"] > 0 and tp2["tokens_per_step"] == rows["tp1"]["tokens_per_step"]
    assert "needs 4 GPUs" in rows["tp2pp2"]["skipped"]  # --gpus defaults to 2 on the CPU


@pytest.mark.slow
def test_distributed_sync_serves_the_same_weights_as_full_and_delta(tmp_path):
    record = run("sync", tmp_path, "--repeats", "2", "--bucket-mb", "0.05", "--lr", "1e-2")
    assert record["transport"] == "gloo"
    rows = {r["method"]: r for r in record["results"]}
    assert set(rows) == {"distributed", "full", "delta"}
    for row in rows.values():
        assert row["same_weights_every_method"] is True
        assert row["probe_changed_every_version"] is True
        assert len(row["t_W_s_all"]) == 2 and row["t_W_s"] > 0
    # several buckets of 0.05 MiB for the ~0.16 MB tiny model; a delta ships less than full
    assert rows["distributed"]["bytes"] > 3 * record["bucket_bytes"]
    assert rows["delta"]["wire_bytes"] < rows["full"]["wire_bytes"]
