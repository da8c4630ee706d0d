"""examples/math_dataset.py runs as written: a verl-style math Parquet file, read with
--label-key reward_model.ground_truth, goes through rollout (math reward) and train."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rltool.data.shards import open_shard

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math_dataset.py"


@pytest.mark.slow
def test_math_dataset_example(tmp_path, tiny_model_dir):
    out = tmp_path / "math"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(out), "--num-prompts", "8",
                           "--model", str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--label-key reward_model.ground_truth" in proc.stdout
    rows = open_shard(out / "rollouts" / "step-000000").rows()
    assert len(rows) == 32
    for row in rows:  # "user: what is A+B?" with label A+B, from the nested ground truth
        a, b = row["prompt"].removeprefix("user: what is ").removesuffix("?").split("+")
        assert row["label"] == str(int(a) + int(b))
    (published,) = (out / "weights").glob("weight_v*")  # one optimizer step: one new version
    assert (published / "config.json").is_file() and f"is {published}" in proc.stdout
    assert (out / "train" / "ckpt" / published.name.replace("weight_v", "step-")).is_dir()
