"""The trace writer: whole JSONL lines per process, nothing written when off, a stage's scope
restores the process state, torn lines skipped by the reader, Chrome output re-laned."""

from __future__ import annotations

import json
import os
import threading

import pytest

from rltool import trace
from rltool.errors import BadInputError
from rltool.profile.events import chrome_trace, read_events


@pytest.fixture(autouse=True)
def _no_tracer():
    trace.configure(None, role="test")
    yield
    trace.configure(None, role="test")


def test_off_writes_nothing(tmp_path):
    with trace.span("x") as args:
        args["k"] = 1
    assert trace.writer() is None and not any(tmp_path.iterdir())


def test_spans_threads_and_counters(tmp_path):
    w = trace.configure(tmp_path, role="unit")
    assert os.environ[trace.ENV_DIR] == str(tmp_path)

    def work(i):
        for _ in range(50):
            with trace.span("work", cat="test", i=i) as ev:
                ev["done"] = True

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trace.counter("in_flight", requests=3)
    trace.configure(None, role="unit")
    assert trace.ENV_DIR not in os.environ
    lines = (tmp_path / f"unit-{os.getpid()}.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert events[0] == {"name": "process_name", "ph": "M", "ts": 0, "args": {"name": "unit"},
                         "pid": w.pid, "tid": events[0]["tid"]}
    work_events = [e for e in events if e["name"] == "work"]
    assert len(work_events) == 200 and all(e["dur"] >= 0 and e["args"]["done"]
                                           for e in work_events)
    assert events[-1]["ph"] == "C" and events[-1]["args"] == {"requests": 3}


def test_scope_keeps_an_outer_tracer_and_restores_off(tmp_path):
    with trace.scope(tmp_path / "beside", role="rollout"):
        with trace.span("a"):
            pass
    assert trace.writer() is None
    assert len(list((tmp_path / "beside").glob("rollout-*.jsonl"))) == 1
    trace.configure(tmp_path / "run", role="loop")
    with trace.scope(tmp_path / "other", role="rollout"):
        with trace.span("b"):
            pass
    trace.flush()
    assert not (tmp_path / "other").exists()
    assert '"name":"b"' in next((tmp_path / "run").glob("loop-*.jsonl")).read_text()


def test_reader_skips_torn_lines_and_refuses_empty(tmp_path):
    (tmp_path / "a-1.jsonl").write_text(
        json.dumps({"name": "s", "ph": "X", "ts": 10, "dur": 5, "pid": 1, "tid": 1}) + "\n"
        + '{"name": "torn", "ph": "X", "ts"')
    assert [e["name"] for e in read_events(tmp_path)] == ["s"]
    (tmp_path / "a-1.jsonl").write_text("")
    with pytest.raises(BadInputError, match="no complete trace events"):
        read_events(tmp_path)
    with pytest.raises(BadInputError, match="no such run"):
        read_events(tmp_path / "missing")


def test_overlapping_requests_get_lanes_and_nested_spans_do_not():
    events = [{"name": n, "ph": "X", "ts": ts, "dur": d, "pid": 1, "tid": 7, "_role": "loop"}
              for n, ts, d in (("outer", 0, 100), ("inner", 10, 20), ("r1", 40, 50),
                               ("r2", 50, 80))]
    out = chrome_trace(events)["traceEvents"]
    tids = {e["name"]: e["tid"] for e in out if e["ph"] == "X"}
    assert tids["outer"] == tids["inner"] == tids["r1"] == 7
    assert tids["r2"] != 7  # starts inside r1 and ends after it
    assert any(e["ph"] == "M" and e["tid"] == tids["r2"] for e in out)


def test_no_event_no_file(tmp_path):
    """A stage that refuses its input before any span leaves nothing on disk (the trace folder
    beside its output used to appear at once)."""
    with trace.scope(tmp_path / "runs" / "trace", role="rollout"):
        pass
    assert not (tmp_path / "runs").exists()
