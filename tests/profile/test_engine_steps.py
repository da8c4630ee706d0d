"""rltool.profile.engine_steps: a traced engine's decode steps split into device work (the
forward and sampler spans inside a step) and host work (the rest), on synthetic events with
known intervals."""

from __future__ import annotations

import pytest

from rltool.profile.engine_steps import decode_steps


def span(name: str, ts: float, dur: float, *, tid: int = 1, **args) -> dict:
    event = {"name": name, "cat": "engine", "ph": "X", "ts": ts, "dur": dur, "pid": 7,
             "tid": tid, "_role": "engine"}
    if args:
        event["args"] = args
    return event


def test_device_work_is_the_forward_and_sampler_inside_the_step_of_its_thread():
    events = [
        span("decode.step", 0, 100, batch=4),
        span("decode.forward", 10, 50),
        span("decode.sample", 90, 10.1),          # ends 0.1 µs past the step (rounding)
        span("decode.forward", 20, 30, tid=2),    # another thread: not this step's
        span("decode.step", 200, 40, batch=3),
        span("decode.forward", 150, 20),          # between steps: no step's
    ]
    rows = decode_steps(events)
    assert [r["batch"] for r in rows] == [4, 3]
    assert rows[0]["device_us"] == pytest.approx(60.1)
    assert rows[0]["host_us"] == pytest.approx(39.9)
    assert rows[1] == {"batch": 3, "steps": 1, "wall_us": 40, "device_us": 0, "host_us": 40}


def test_a_block_of_steps_counts_as_that_many_steps():
    rows = decode_steps([span("decode.step", 0, 400, batch=8, steps=4),
                         span("decode.forward", 0, 100), span("decode.forward", 100, 100)])
    assert rows == [{"batch": 8, "steps": 4, "wall_us": 100, "device_us": 50, "host_us": 50}]
