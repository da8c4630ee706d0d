"""Running a Triton test module once more in a child process with TRITON_INTERPRET=1 (Triton
decides interpreted or compiled for the whole process when it is first imported), and checking
each test's outcome there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def child_report(test_file: str, child_var: str, tmp_dir: Path,
                 timeout: int) -> dict[str, str] | None:
    """Without CUDA: {test name: failure text, "" when it passed} of `test_file` run in a child
    process with TRITON_INTERPRET=1 and `child_var`=1; None on CUDA or in the child."""
    if torch.cuda.is_available() or os.environ.get(child_var) == "1":
        return None
    import xml.etree.ElementTree as ET

    report = tmp_dir / "report.xml"
    module = Path(test_file).resolve()
    root = module.parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", child_var: "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={report}", str(module)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert report.is_file(), proc.stdout[-4000:] + proc.stderr[-2000:]
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        out[case.get("name")] = "" if bad is None else (bad.text or bad.get("message") or "?")
    return out


def ran_in_child(request) -> bool:
    """True (after asserting the child's outcome for this test) when the child ran it; needs
    the module's `child_report` fixture."""
    report = request.getfixturevalue("child_report")
    if report is None:
        return False
    name = request.node.name
    assert name in report, f"{name} did not run in the child process"
    assert report[name] == "", report[name][-4000:]
    return True
