"""A short CPU loop profiled end to end: every step's phases are all traced, in order, and every
piece of traced work inside a step lies inside one of its phases (checked on the trace's
structure, not by comparing durations, which a loaded machine stretches), the Chrome trace
holds only the Trace Event Format's documented fields (reference data checked in beside this
test), and `plan --check` reports the error of each checkable prediction."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from rltool import trace
from rltool.cli import main as cli
from rltool.data.tasks import make_rows, write_prompts
from rltool.loop.config import LoopSettings
from rltool.loop.runner import start
from rltool.profile.events import read_events, spans

PHASES = ("rollout", "train", "publish", "sync", "record")  # a step's phases, in order (no eval)
REFERENCE = json.loads((Path(__file__).parent / "trace_event_format.json").read_text())
TYPES = {"string": str, "number": (int, float), "integer": int, "object": dict}


@pytest.fixture(scope="module")
def traced_run(tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("profiled")
    write_prompts(make_rows("reverse", num=8, seed=1), root / "rl.jsonl")
    settings = LoopSettings.from_tables({
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"prompts": str(root / "rl.jsonl"), "reward": "reverse:partial",
                    "n_samples_per_prompt": 2, "rollout_batch_size": 2, "max_response_len": 6},
        "train": {"lr": 1e-2, "global_batch_size": 2},
        "sync": {"sync": "full"},
        "loop": {"num_steps": 3, "seed": 3}})
    os.environ[trace.ENV_TORCH_STEPS] = "1"
    try:
        start(settings, root / "run")
    finally:
        del os.environ[trace.ENV_TORCH_STEPS]
    return root / "run"


def validate_chrome_trace(doc: dict) -> None:
    fmt = REFERENCE["object_format"]
    assert set(fmt["required"]) <= doc.keys() <= set(fmt["required"] + fmt["optional"])
    assert doc["displayTimeUnit"] in fmt["displayTimeUnit"]
    for event in doc["traceEvents"]:
        spec = REFERENCE["phases"][event["ph"]]
        assert set(spec["required"]) <= event.keys(), event
        for key, value in event.items():
            assert isinstance(value, TYPES[REFERENCE["event_fields"][key]]), (key, event)
        if event["ph"] == "M":
            assert event["name"] in spec["names"] and isinstance(event["args"]["name"], str)
        if event["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in event["args"].values())
    # complete events of one thread nest
    stacks: dict[tuple, list[float]] = {}
    for e in sorted((e for e in doc["traceEvents"] if e["ph"] == "X"),
                    key=lambda e: (e["ts"], -e["dur"])):
        stack = stacks.setdefault((e["pid"], e["tid"]), [])
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        assert not stack or e["ts"] + e["dur"] <= stack[-1] + 1.0, e
        stack.append(e["ts"] + e["dur"])


def check_phases_cover_steps(events: list[dict]) -> None:
    """The phases of every step, in order and without overlap (the state bookkeeping between
    them is traced as `record` too), and every other span of the loop process that overlaps the
    step inside one of them: nothing the loop traces in a step falls outside its phases.
    Structure only; no duration is compared with another."""
    def end(e: dict) -> float:
        return e["ts"] + e["dur"]

    def within(e: dict, window: dict) -> bool:
        return window["ts"] <= e["ts"] and end(e) <= end(window) + 1.0  # 1 us of rounding

    steps = spans(events, name="step", cat="step", role="loop")
    phases = spans(events, cat="phase", role="loop")
    work = [e for e in spans(events, role="loop") if e.get("cat") not in ("step", "phase")]
    assert len(steps) == 3
    for step in steps:
        inside = sorted((p for p in phases if within(p, step)), key=lambda p: p["ts"])
        names = [p["name"] for p in inside]  # the bookkeeping after each phase is `record`
        assert [n for n in names if n != "record"] == list(PHASES[:-1]) and names[-1] == "record"
        assert all(end(a) <= b["ts"] + 1.0 for a, b in zip(inside, inside[1:])), inside
        overlapping = [e for e in work if e["ts"] < end(step) and end(e) > step["ts"]]
        assert {"generate", "reward", "train_step", "weight_load"} <= {e["name"]
                                                                       for e in overlapping}
        for e in overlapping:
            assert any(within(e, p) for p in inside), (e, step)


def test_profile_of_a_short_loop(traced_run, tmp_path):
    result = CliRunner().invoke(cli, ["profile", str(traced_run), "--json", "--out",
                                      str(tmp_path / "t.json")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert [r["step"] for r in summary["steps"]] == [0, 1, 2]
    for row in summary["steps"]:
        assert set(PHASES) <= row.keys(), row
    check_phases_cover_steps(read_events(traced_run))
    assert {"loop", "serve"} <= set(summary["processes"])
    engine = next(iter(summary["engines"].values()))
    # 3 steps of 2 groups: the groups a step starts together go to the engine as one batched
    # request (rltool.rollout.batching), well under --samples-per-request.
    assert engine["requests"] == 3 and engine["completion_tokens"] > 0
    assert 0 < summary["wait_ratios"]["trainer"]["wait_ratio"] < 1
    assert summary["async"]["measured_speedup"] == pytest.approx(1.0, abs=0.01)
    doc = json.loads((tmp_path / "t.json").read_text())
    validate_chrome_trace(doc)
    names = {e["name"] for e in doc["traceEvents"]}
    assert {"step", "rollout", "train", "publish", "sync", "generate", "reward", "train_step",
            "weight_load", "offload", "reload", "engine_start"} <= names


def test_plan_check_on_the_run(traced_run):
    result = CliRunner().invoke(cli, ["plan", "--check", str(traced_run), "--json"])
    assert result.exit_code == 0, result.output
    checks = {c["prediction"].split(" (")[0]: c for c in json.loads(result.output)["checks"]}
    # norms and biases are all the formula leaves out of the tiny qwen2
    assert abs(checks["weight bytes"]["relative_error"]) < 0.02
    assert checks["t_W"]["measured"] > 0 and checks["t_sync"]["measured"] > 0


def test_plan_from_profile_uses_measurements(traced_run, tiny_model_dir):
    result = CliRunner().invoke(cli, ["plan", "--model", str(tiny_model_dir), "--from-profile",
                                      str(traced_run), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    async_model = next(m for m in out["models"] if m["model"] == "async")
    assert async_model["inputs"]["t_R_s"] == pytest.approx(out["measured"]["t_R_s"])
    assert out["measured"]["prompt_tokens"] > 0


def test_torch_profiler_steps(traced_run):
    ok = CliRunner().invoke(cli, ["profile", str(traced_run), "--torch-profiler", "1", "--json"])
    assert ok.exit_code == 0, ok.output
    kernels = json.loads(ok.output)["kernel_traces"]["1"]
    assert kernels["files"] and any(k["op"].startswith("aten::") for k in kernels["top_ops"])
    for steps, message in (("0", "RLTOOL_TORCH_PROFILE_STEPS=0"), ("x", "step numbers")):
        bad = CliRunner().invoke(cli, ["profile", str(traced_run), "--torch-profiler", steps])
        assert bad.exit_code == 2 and message in bad.output, bad.output
