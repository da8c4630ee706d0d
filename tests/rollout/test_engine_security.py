"""Auth, body limits and weight-root confinement on an in-process app (no subprocess needed)."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from rltool.engine.app import EngineState, build_app
from rltool.engine.config import ServeConfig
from rltool.engine.model_runner import ModelRunner
from rltool.engine.scheduler import Scheduler


@pytest.fixture(scope="module")
def secured(tiny_model_dir):
    cfg = ServeConfig(model=tiny_model_dir, api_key="user-key", admin_api_key="admin-key",
                      max_request_bytes=4096)
    runner = ModelRunner(tiny_model_dir)
    sched = Scheduler(runner, max_running=4)
    sched.start()
    app = build_app(EngineState(cfg=cfg, runner=runner, scheduler=sched, started=time.monotonic()))
    with TestClient(app) as client:
        yield client
    sched.stop()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}


def test_health_is_open_and_other_routes_need_a_key(secured):
    assert secured.get("/health").status_code == 200
    assert secured.get("/health_generate").status_code == 200
    assert secured.post("/generate", json=GEN).status_code == 401
    assert secured.post("/generate", json=GEN, headers=auth("wrong")).status_code == 401
    assert secured.get("/get_model_info").status_code == 401
    assert secured.post("/generate", json=GEN, headers=auth("user-key")).status_code == 200
    # The admin key is a superset: one client holding it can drive everything.
    assert secured.post("/generate", json=GEN, headers=auth("admin-key")).status_code == 200


def test_admin_routes_need_the_admin_key(secured):
    body = {"mode": "abort"}
    assert secured.post("/pause_generation", json=body, headers=auth("user-key")).status_code == 401
    assert secured.post("/pause_generation", json=body,
                        headers=auth("admin-key")).status_code == 200
    assert secured.post("/continue_generation", json={},
                        headers=auth("admin-key")).status_code == 200
    assert secured.post("/flush_cache", headers=auth("user-key")).status_code == 401


def test_oversized_bodies_get_413_and_serving_continues(secured):
    big = {"input_ids": [5] * 3000}
    assert secured.post("/generate", json=big, headers=auth("user-key")).status_code == 413

    def chunks():  # no Content-Length: the limit holds while streaming the body in
        yield b'{"input_ids": ['
        for _ in range(2000):
            yield b"5, "
        yield b"5]}"

    r = secured.post("/generate", content=chunks(), headers=auth("user-key"))
    assert r.status_code == 413
    assert secured.post("/generate", json=GEN, headers=auth("user-key")).status_code == 200


def test_weight_paths_outside_the_allowed_roots_are_refused(secured, tmp_path):
    r = secured.post("/update_weights_from_disk", json={"model_path": str(tmp_path)},
                     headers=auth("admin-key"))
    assert r.status_code == 400 and "outside the allowed weight roots" in r.json()["message"]
    r = secured.post("/update_weights_from_disk", json={"model_path": "/etc/../etc"},
                     headers=auth("admin-key"))
    assert r.status_code == 400 and r.json()["success"] is False


def test_debug_hidden_states_needs_the_admin_key(secured):
    """Regression: /debug/hidden_states (weights introspection) only asked for the user key."""
    body = {"input_ids": [5, 6]}
    assert secured.post("/debug/hidden_states", json=body, headers=auth("user-key")).status_code == 401


def test_pull_weights_seeds_version_0_from_the_engines_model_and_refuses_a_missing_link(
        secured, tiny_model_dir, tmp_path):
    """/pull_weights with an empty source: version 0 is the engine's own --model (slime's rule);
    a version that is not published is refused with 400 and SGLang's {success, message} shape."""
    local = tiny_model_dir.parent / f"pull-local-{tmp_path.name}"
    source = tiny_model_dir.parent / f"pull-source-{tmp_path.name}"
    source.mkdir()
    body = {"local_checkpoint_dir": str(local), "source_dir": str(source), "target_version": 0}
    r = secured.post("/pull_weights", json=body, headers=auth("admin-key"))
    assert r.status_code == 200 and r.json()["success"] is True
    assert r.json()["message"] == "Success."
    assert (local / "model.safetensors").read_bytes() == \
        (tiny_model_dir / "model.safetensors").read_bytes()
    r = secured.post("/pull_weights", json={**body, "target_version": 3},
                     headers=auth("admin-key"))
    assert r.status_code == 400 and r.json()["success"] is False and r.json()["message"]
