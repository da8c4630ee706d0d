"""The engine's route table: every state-changing route carries the admin guard where it is defined,
the hot routes carry no per-route dependency, and the client speaks the server's paths."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import time

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from rltool.engine import api
from rltool.engine.app import EngineState, build_app
from rltool.engine.config import ServeConfig
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.security import require_admin

# The only routes without the admin guard, each for its reason. Anything else the app serves
# changes state or reveals more than it should, so it must be an admin route.
INFERENCE = {"/generate", "/v1/completions", "/v1/chat/completions"}  # what users are for
READ_ONLY = {"/health", "/ready", "/health_generate", "/v1/loads", "/get_model_info",
             "/model_info", "/get_server_info", "/server_info", "/get_weight_version",
             "/weight_version", "/v1/models", "/v1/models/{model_id:path}"}


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32")
    sched = PagedScheduler(runner, max_running=2)
    cfg = ServeConfig(model=tiny_model_dir, api_key="user-key", admin_api_key="admin-key",
                      enable_debug_endpoints=True, local_checkpoint_dir=tiny_model_dir.parent)
    sched.start()
    yield build_app(EngineState(cfg=cfg, runner=runner, scheduler=sched,
                                started=time.monotonic()))
    sched.stop()


def guarded(route: APIRoute) -> bool:
    return any(d.call is require_admin for d in route.dependant.dependencies)


def test_every_state_changing_route_carries_the_admin_guard(app):
    """Regression: the admin routes were a hand-kept list of paths in the middleware, apart from
    where routes are defined, so a new state-changing route was open to every user-key holder."""
    routes = [r for r in app.routes]
    assert routes and all(isinstance(r, APIRoute) for r in routes), \
        [r.path for r in routes if not isinstance(r, APIRoute)]
    admin = set()
    for route in routes:
        if route.path in INFERENCE | READ_ONLY:
            assert not guarded(route), f"{route.path} needs no admin key"
            # Nothing per route on the paths every request takes: the Guard middleware checks
            # the API key, so these routes pay no dependency resolution.
            assert route.dependant.dependencies == [], route.path
            if route.path in READ_ONLY:
                assert route.methods <= {"GET", "HEAD"}, route.path
        else:
            assert guarded(route), f"{route.path} {sorted(route.methods)} lacks the ADMIN guard"
            admin.add(route.path)
    # The concerns the issue names are all there (and so are guarded).
    assert {api.UPDATE_WEIGHTS_FROM_DISK, api.UPDATE_WEIGHT_VERSION, api.PULL_WEIGHTS,
            api.RELEASE_MEMORY, api.RESUME_MEMORY, api.PAUSE_GENERATION,
            api.CONTINUE_GENERATION, api.ABORT_REQUEST, api.FLUSH_CACHE,
            api.DEBUG_HIDDEN_STATES} <= admin


def test_the_admin_guard_refuses_the_user_key_on_every_admin_route(app):
    with TestClient(app) as client:
        for route in app.routes:
            if not guarded(route):
                continue
            for method in sorted(route.methods):
                r = client.request(method, route.path, json={},
                                   headers={"Authorization": "Bearer user-key"})
                assert r.status_code == 401, (method, route.path, r.status_code)
                assert r.json() == {"error": {"message": "Unauthorized: send Authorization: "
                                                         "Bearer <key>"}}


def test_the_admin_guard_runs_inline():
    """FastAPI runs a plain `def` dependency in a worker thread; the guard must be a coroutine
    without sub-dependencies so that it costs one header comparison."""
    assert inspect.iscoroutinefunction(require_admin)
    assert list(inspect.signature(require_admin).parameters) == ["request"]


def test_the_client_sends_only_paths_the_server_serves(app):
    """EngineClient and the server share rltool.engine.api: every path the client uses exists."""
    import rltool.rollout.client as client_module

    served = {r.path for r in app.routes}
    source = inspect.getsource(client_module)
    used = {getattr(api, name) for name in dir(api)
            if name.isupper() and isinstance(getattr(api, name), str)
            and getattr(api, name).startswith("/") and f"api.{name}" in source}
    assert len(used) >= 12 and used <= served, used - served
    assert not re.findall(r"[\"']/[a-z]", source)  # no route path spelled out a second time


def test_importing_rltool_align_does_not_load_the_server():
    """Regression: rltool.align.layerwise imported the route path from the engine's debug module,
    which dragged in the server (fastapi, the model runner) for every align-gate run."""
    code = ("import importlib, pkgutil, sys, rltool.align as a\n"
            "for m in pkgutil.iter_modules(a.__path__):\n"
            "    importlib.import_module('rltool.align.' + m.name)\n"
            "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('fastapi', 'starlette',"
            " 'uvicorn') or n.startswith(('rltool.engine.app', 'rltool.engine.routes',"
            " 'rltool.engine.server')))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
