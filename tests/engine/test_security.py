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

    r = secured.post("/generate", content=chunks(),
                     headers={**auth("user-key"), "Content-Type": "application/json"})
    assert r.status_code == 413
    r = secured.post("/v1/completions", content=chunks(),
                     headers={**auth("user-key"), "Content-Type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
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


# ----- web pages: Content-Type, Origin and Host ------------------------------------------------

ATTACKER = "http://evil.example"
LOOPBACK = {"Host": "127.0.0.1:30000"}
PAUSE = '{"mode": "abort"}'


@pytest.fixture
def open_engine(make_client, tiny_model_dir):
    """The default setup: loopback, no key. Whatever a test's request does to the shared
    scheduler is undone afterwards (continue, resume), so a failing test leaves it serving."""
    client = make_client(model=tiny_model_dir)
    yield client
    client.post("/continue_generation", json={}, headers=LOOPBACK)
    client.post("/resume_memory_occupation", json={}, headers=LOOPBACK)


def serving(client) -> bool:
    return client.get("/ready", headers=LOOPBACK).status_code == 200


def refusal(r, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert "\n" not in message
    return message


@pytest.mark.parametrize("path,content_type,body", [
    ("/pause_generation", "text/plain", PAUSE),
    ("/pause_generation", "text/plain;charset=UTF-8", PAUSE),
    ("/pause_generation", "application/x-www-form-urlencoded", PAUSE),
    ("/pause_generation", "multipart/form-data; boundary=x", PAUSE),
    ("/pause_generation", None, PAUSE),
    ("/release_memory_occupation", "text/plain", "{}"),
    ("/continue_generation", "text/plain", "{}"),
    ("/abort_request", "text/plain", '{"abort_all": true}'),
    ("/update_weight_version", "text/plain", '{"new_version": "evil"}'),
    ("/generate", "text/plain", '{"input_ids": [5, 6]}'),
    ("/v1/completions", "text/plain", '{"prompt": "ab", "max_tokens": 1}'),
    ("/v1/chat/completions", "text/plain", '{"messages": [{"role": "user", "content": "a"}]}'),
])
def test_a_body_that_is_not_json_gets_415_and_changes_nothing(open_engine, path, content_type,
                                                               body):
    """Regression: parse_body parsed any body whatever its Content-Type, so a web page's
    `text/plain` POST (which a browser sends without asking the server first) paused the engine
    and drove every other route."""
    headers = {**LOOPBACK, **({"Content-Type": content_type} if content_type else {})}
    r = open_engine.post(path, content=body, headers=headers)
    assert "Content-Type: application/json" in refusal(r, 415)
    assert serving(open_engine)
    assert open_engine.get("/get_weight_version", headers=LOOPBACK).json()["weight_version"] \
        != "evil"


def test_the_measured_attack_is_refused(open_engine):
    """Regression: a `text/plain` POST with `Origin: http://evil.example` and `Host:
    evil.example:30000` (a DNS-rebound page) answered 200 and paused the engine; so did
    /continue_generation. Nothing checked Host or Origin."""
    for path in ("/pause_generation", "/continue_generation"):
        r = open_engine.post(path, content=PAUSE, headers={
            "Host": "evil.example:30000", "Origin": f"{ATTACKER}:30000",
            "Content-Type": "text/plain"})
        assert "--allowed-hosts" in refusal(r, 421)
        assert serving(open_engine)


def test_a_host_that_is_not_the_engines_gets_421(open_engine):
    """Regression: the Host header was not checked, so a page whose own name was re-pointed at
    127.0.0.1 (DNS rebinding) could call the engine as its own origin and read the answers."""
    for host in ("evil.example", "evil.example:30000", "localhost.evil.example", "10.1.2.3"):
        r = open_engine.get("/get_model_info", headers={"Host": host})
        assert "--allowed-hosts" in refusal(r, 421), host
        r = open_engine.post("/pause_generation", json={"mode": "abort"}, headers={"Host": host})
        assert r.status_code == 421 and serving(open_engine), host
    for host in ("127.0.0.1:30000", "localhost", "LOCALHOST:1234", "[::1]:30000", "127.0.0.2"):
        assert open_engine.get("/get_model_info", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_names_are_accepted(make_client, tiny_model_dir):
    client = make_client(model=tiny_model_dir, allowed_hosts=["engine.internal", "10.1.2.3"])
    for host in ("engine.internal", "Engine.Internal:30000", "10.1.2.3:8000", "localhost"):
        assert client.post("/generate", json=GEN, headers={"Host": host}).status_code == 200, host
    assert client.get("/get_model_info", headers={"Host": "evil.example"}).status_code == 421
    anything = make_client(model=tiny_model_dir, allowed_hosts=["*"])
    assert anything.get("/get_model_info", headers={"Host": "evil.example"}).status_code == 200


def test_a_wildcard_bind_accepts_ip_hosts_and_only_listed_names(make_client, tiny_model_dir):
    """Bound to 0.0.0.0 the engine cannot know all its own addresses: any IP address is a valid
    Host (rebinding needs a name), a name only when listed."""
    client = make_client(model=tiny_model_dir, host="0.0.0.0", admin_api_key="admin-key",
                         allowed_hosts=["node1"])
    for host in ("10.1.2.3:30000", "[fd00::5]:30000", "node1:30000", "localhost"):
        assert client.get("/get_model_info", headers={"Host": host}).status_code == 200, host
    assert client.get("/get_model_info", headers={"Host": "node2:30000"}).status_code == 421


@pytest.mark.parametrize("headers", [
    {"Origin": ATTACKER},
    {"Origin": "http://localhost:8080"},  # another local web app's page
    {"Origin": "null"},  # a sandboxed frame or a file:// page
    {"Sec-Fetch-Site": "cross-site"},  # what an <img> or a form sends without an Origin
    {"Sec-Fetch-Site": "same-site"},
])
def test_a_cross_origin_request_that_changes_state_gets_403(open_engine, headers):
    """Regression: nothing checked `Origin`, so any web page could pause, abort, flush or release
    the default (loopback, keyless) engine."""
    headers = {**LOOPBACK, **headers}
    assert "from a program" in refusal(
        open_engine.post("/pause_generation", json={"mode": "abort"}, headers=headers), 403)
    assert serving(open_engine)
    # /release_memory_occupation answers GET too (as in SGLang): a cross-site <img> is refused.
    refusal(open_engine.get("/release_memory_occupation", headers=headers), 403)
    assert serving(open_engine)
    for path in ("/flush_cache", "/generate", "/v1/completions"):
        assert open_engine.post(path, headers=headers).status_code == 403, path
    # A read is no use to such a page (no CORS headers: the browser keeps the answer from it).
    assert open_engine.get("/get_model_info", headers=headers).status_code == 200


def test_same_origin_and_plain_program_requests_are_served(open_engine):
    same = {**LOOPBACK, "Origin": "http://127.0.0.1:30000", "Sec-Fetch-Site": "same-origin"}
    assert open_engine.post("/generate", json=GEN, headers=same).status_code == 200
    typed = {**LOOPBACK, "Content-Type": "application/json; charset=utf-8"}
    assert open_engine.post("/generate", content=b'{"input_ids": [5, 6]}',
                            headers=typed).status_code == 200
    # A typed-in URL (Sec-Fetch-Site: none), a bodiless POST without a Content-Type (what
    # rltool's client sends for /flush_cache) and an empty JSON-less one are served.
    assert open_engine.get("/flush_cache", headers={**LOOPBACK, "Sec-Fetch-Site": "none"}
                           ).status_code == 200
    assert open_engine.post("/flush_cache", headers=LOOPBACK).status_code == 200
    assert open_engine.post("/release_memory_occupation", headers=LOOPBACK).status_code == 200
    assert not serving(open_engine)
    assert open_engine.post("/resume_memory_occupation", headers=LOOPBACK).status_code == 200
    assert serving(open_engine)


def test_rltool_client_drives_a_live_engine(builtin_engine):
    """rltool's own client (JSON bodies, bodiless control POSTs, Host from the URL) passes the
    checks of a real server, which refuses a foreign Host and a text/plain body."""
    import httpx

    from tests.helpers.engines import engine_call

    url = builtin_engine.url
    assert engine_call(url, "get_model_info")["weight_version"]
    out = engine_call(url, "generate", {"input_ids": [5, 6], "sampling_params": GEN[
        "sampling_params"]})
    assert len(out["output_ids"]) == 2
    engine_call(url, "flush_cache")
    engine_call(url, "abort_request", rid="no-such-request")
    assert engine_call(url, "has_route", "/pull_weights")
    r = httpx.get(url + "/get_model_info", headers={"Host": "evil.example"}, timeout=30)
    assert r.status_code == 421
    r = httpx.post(url + "/abort_request", content=b'{"abort_all": true}',
                   headers={"Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 415
    assert httpx.get(url + "/ready", timeout=30).status_code == 200


@pytest.mark.parametrize("value", ["http://engine.internal", "engine.internal:30000",
                                   "engine internal", "a/b"])
def test_allowed_hosts_takes_plain_names(tiny_model_dir, value):
    with pytest.raises(ValueError, match="--allowed-hosts"):
        ServeConfig(model=tiny_model_dir, allowed_hosts=[value])


def test_allowed_hosts_is_a_serve_flag_of_the_builtin_engine_only(tiny_model_dir):
    from click.testing import CliRunner

    from rltool.commands.serve import command

    assert "--allowed-hosts" in CliRunner().invoke(command, ["--help"]).output
    with pytest.raises(ValueError, match="--engine builtin"):
        ServeConfig(engine="sglang", model=tiny_model_dir, allowed_hosts=["node1"])


def test_the_key_table_lists_every_admin_route(secured):
    """Regression: docs/reliability.md's key table left out the three in-memory weight routes
    (/update_weights_from_tensor, /init_weights_update_group, /update_weights_from_distributed)."""
    import re
    from pathlib import Path

    from rltool.engine.security import admin_paths

    doc = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `--admin-api-key` |"))
    listed = set(re.findall(r"`(/[\w/]+)`", row.split("|")[2]))
    served = admin_paths(secured.app.routes)
    assert len(served) >= 13 and listed == served, (served - listed, listed - served)


def test_a_link_inside_a_weight_root_to_a_file_outside_is_refused(secured, tiny_model_dir,
                                                                  tmp_path):
    """The directory is under the roots but one of its files links outside them: refused, the
    served weights untouched."""
    outside = tmp_path / "outside"
    shutil.copytree(tiny_model_dir, outside)
    inside = tiny_model_dir.parent / "linked-weights"
    inside.mkdir()
    for f in outside.iterdir():
        (inside / f.name).symlink_to(f)
    greedy = {**GEN, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    before = secured.post("/generate", json=greedy, headers=auth("user-key")).json()
    r = secured.post("/update_weights_from_disk", json={"model_path": str(inside)},
                     headers=auth("admin-key"))
    assert r.status_code == 400 and "a link to a path outside the allowed" in r.json()["message"]
    after = secured.post("/generate", json=greedy, headers=auth("user-key")).json()
    assert (after["output_ids"], after["meta_info"]["weight_version"]) == (
        before["output_ids"], before["meta_info"]["weight_version"])
