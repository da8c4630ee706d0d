"""Auth, body limits and path confinement on in-process apps (no subprocess needed)."""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import pytest
from fastapi.testclient import TestClient

from rltool.engine.app import EngineState, build_app
from rltool.engine.config import ServeConfig
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler


@pytest.fixture(scope="module")
def engine_parts(tiny_model_dir):
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32")
    sched = PagedScheduler(runner, max_running=4)
    sched.start()
    yield runner, sched
    sched.stop()


@pytest.fixture(scope="module")
def make_client(engine_parts):
    """Build an app over the shared runner and scheduler with the given ServeConfig fields."""
    runner, sched = engine_parts
    clients = []

    def make(**cfg_fields) -> TestClient:
        cfg = ServeConfig(**cfg_fields)
        app = build_app(EngineState(cfg=cfg, runner=runner, scheduler=sched,
                                    started=time.monotonic()))
        client = TestClient(app)
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close()


@pytest.fixture(scope="module")
def secured(make_client, tiny_model_dir):
    return make_client(model=tiny_model_dir, api_key="user-key", admin_api_key="admin-key",
                       max_request_bytes=4096, enable_debug_endpoints=True)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir):
    """A run as the loop lays it out: published versions in weights/, the engines' host-local
    directory in engine_local/; the engine serves weights/weight_v000000."""
    run = tmp_path_factory.mktemp("run")
    for v in (0, 1):
        shutil.copytree(tiny_model_dir, run / "weights" / f"weight_v{v:06d}")
    (run / "weights" / "notes.txt").write_text("not a weight file")
    (run / "engine_local").mkdir()
    return run


@pytest.fixture(scope="module")
def run_engine(make_client, run_dir):
    return make_client(model=run_dir / "weights" / "weight_v000000", admin_api_key="admin-key",
                       local_checkpoint_dir=run_dir / "engine_local")


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def tree(root) -> dict[str, str]:
    """{relative path: sha256} of every file under root (links not followed)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


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


def test_admin_key_alone_guards_admin_routes_and_leaves_the_rest_open(make_client, tiny_model_dir):
    client = make_client(model=tiny_model_dir, admin_api_key="admin-key")
    assert client.post("/generate", json=GEN).status_code == 200
    assert client.get("/get_weight_version").status_code == 200
    assert client.post("/pause_generation", json={}).status_code == 401
    assert client.post("/abort_request", json={}, headers=auth("wrong")).status_code == 401
    assert client.post("/abort_request", json={}, headers=auth("admin-key")).status_code == 200


def test_server_info_does_not_reveal_the_keys(secured):
    """Regression: /get_server_info dumped the whole config, so any holder of the ordinary API key
    could read the admin key there and take over the weight routes."""
    r = secured.get("/get_server_info", headers=auth("user-key"))
    assert r.status_code == 200 and r.json()["engine"] == "builtin"
    assert "admin-key" not in r.text and "user-key" not in r.text


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
    r = secured.post("/v1/completions", content=chunks(),
                     headers={**auth("user-key"), "Content-Type": "application/json"})
    assert r.status_code == 400 and "exceeds" in r.json()["message"]
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
    r = secured.post("/debug/hidden_states", json=body, headers=auth("admin-key"))
    assert r.status_code == 200 and r.json()["num_tokens"] == 2


# ----- /pull_weights confinement ---------------------------------------------------------------


def pull(client, local, source, version=0):
    body = {"local_checkpoint_dir": str(local), "source_dir": str(source),
            "target_version": version}
    return client.post("/pull_weights", json=body, headers=auth("admin-key"))


def test_pull_weights_into_the_runs_published_versions_is_refused(run_engine, run_dir):
    """Regression: `local_checkpoint_dir` only had to lie under a weight root, and the model's
    parent is one, so /pull_weights(local_checkpoint_dir=RUN/weights) replaced the run's published
    weights: it deleted weight_v000000/, weight_v000001/ and every other file there."""
    before = tree(run_dir / "weights")
    r = pull(run_engine, run_dir / "weights", run_dir / "weights", version=1)
    assert r.status_code == 400 and r.json()["success"] is False
    assert "--local-checkpoint-dir" in r.json()["message"]
    assert tree(run_dir / "weights") == before


@pytest.mark.parametrize("where", ["run", "version_dir", "sibling", "symlink", "dotdot"])
def test_pull_weights_writes_only_under_local_checkpoint_dir(run_engine, run_dir, tmp_path, where):
    """Regression: /pull_weights wrote into any directory under a weight root (the run itself, a
    published version, a link out of the local directory), not only --local-checkpoint-dir."""
    local_root = run_dir / "engine_local"
    link = local_root / f"escape-{tmp_path.name}"
    link.symlink_to(run_dir / "weights" / "weight_v000001")
    target = {"run": run_dir, "version_dir": run_dir / "weights" / "weight_v000001",
              "sibling": run_dir / "engine_local2", "symlink": link,
              "dotdot": local_root / ".." / "weights"}[where]
    before = tree(run_dir)
    r = pull(run_engine, target, run_dir / "weights")
    assert r.status_code == 400 and "--local-checkpoint-dir" in r.json()["message"]
    assert tree(run_dir) == before
    link.unlink()


def test_pull_weights_serves_the_local_checkpoint_dir_and_directories_under_it(
        run_engine, run_dir, tiny_model_dir):
    for local in (run_dir / "engine_local", run_dir / "engine_local" / "gpu0"):
        r = pull(run_engine, local, run_dir / "weights", version=1)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert r.json()["pull"]["version"] == 1
        assert (local / "model.safetensors").read_bytes() == \
            (tiny_model_dir / "model.safetensors").read_bytes()


def test_pull_weights_without_a_local_checkpoint_dir_names_the_flag(make_client, run_dir):
    """Regression: an engine started without --local-checkpoint-dir accepted any local directory
    under its weight roots for /pull_weights."""
    client = make_client(model=run_dir / "weights" / "weight_v000000", admin_api_key="admin-key")
    r = pull(client, run_dir / "weights" / "scratch", run_dir / "weights")
    assert r.status_code == 400 and "--local-checkpoint-dir" in r.json()["message"]
    assert not (run_dir / "weights" / "scratch").exists()


def test_pull_weights_source_dir_is_confined_to_the_weight_roots(run_engine, run_dir, tmp_path):
    """Regression: /pull_weights read `source_dir` from anywhere on the engine's host, while
    /update_weights_from_disk confined its model_path to the allowed weight roots."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    link = run_dir / "weights" / f"link-{tmp_path.name}"
    link.symlink_to(outside)
    local = run_dir / "engine_local" / "confined"
    for source in (outside, link):
        r = pull(run_engine, local, source)
        assert r.status_code == 400, r.text
        assert "source_dir" in r.json()["message"] and "allowed weight roots" in r.json()["message"]
    assert not local.exists()
    link.unlink()


def test_pull_weights_refuses_a_source_inside_the_local_dir(run_engine, run_dir):
    """Regression: a source inside the directory being pulled into was accepted, and a pull
    replaces that directory's contents, the source's versions with them."""
    local = run_dir / "engine_local"
    (local / "published").mkdir(exist_ok=True)
    for source in (local, local / "published"):
        r = pull(run_engine, local, source)
        assert r.status_code == 400 and "inside local_checkpoint_dir" in r.json()["message"]


def test_pull_weights_seeds_version_0_from_the_engines_model_and_refuses_a_missing_link(
        run_engine, run_dir, tiny_model_dir):
    """/pull_weights with an empty source: version 0 is the engine's own --model (slime's rule);
    a version that is not published is refused with 400 and SGLang's {success, message} shape."""
    source = run_dir / "weights" / "empty-source"
    source.mkdir()
    local = run_dir / "engine_local" / "seeded"
    r = pull(run_engine, local, source)
    assert r.status_code == 200 and r.json()["success"] is True
    assert r.json()["message"] == "Success."
    assert (local / "model.safetensors").read_bytes() == \
        (tiny_model_dir / "model.safetensors").read_bytes()
    r = pull(run_engine, local, source, version=3)
    assert r.status_code == 400 and r.json()["success"] is False and r.json()["message"]
