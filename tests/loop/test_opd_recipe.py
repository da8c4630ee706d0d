"""The on-policy distillation recipe of docs/train.md (a teacher engine and a student loop) runs
as written: its shell block is extracted and run with bash, `rltool` being this checkout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADING = "### Worked recipe: a teacher engine and a student loop (CPU)"


def recipe_block() -> str:
    text = (ROOT / "docs" / "train.md").read_text()
    after = text[text.index(HEADING):]
    start = after.index("```sh\n") + len("```sh\n")
    return after[start:after.index("```", start)]


@pytest.mark.slow
def test_the_opd_recipe_runs_as_written(tmp_path):
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "rltool").write_text(f"#!/bin/sh\nexec {sys.executable} -m rltool \"$@\"\n")
    (shim / "rltool").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen(["bash", "-c", recipe_block()], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        try:  # the recipe's background engine, if a failing command left it running
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-4000:]
    lines = [json.loads(x) for x in out.splitlines() if x.startswith('{"step"')]
    assert len(lines) == 3 and all(isinstance(x["kl"], float) for x in lines), out[-2000:]
    rollout = [json.loads(x) for x in
               (work / "opd" / "run" / "metrics" / "rollout.jsonl").read_text().splitlines()]
    assert len(rollout) == 3 and all("opd/reverse_kl/teacher" in r for r in rollout)
