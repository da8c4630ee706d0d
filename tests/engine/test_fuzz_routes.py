"""Every route of the builtin engine under generated requests: bodies built from the route table
and the pydantic request models of rltool/engine/api.py (their field names, with values of any
JSON type), in-process. The engine serves no /openapi.json, so the generator reads the app itself.

Properties: no 5xx, no traceback in the answer, the engine still answers /health and /generate
after each request, nothing written under the weight roots. Example counts are fixed
(EXAMPLES_PER_ROUTE) so the test's time is bounded; docs/reliability.md records the totals."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from rltool.engine import api
from rltool.engine.app import EngineState, build_app
from rltool.engine.config import ServeConfig
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.sampling import SamplingParams
from rltool.engine.paged_scheduler import PagedScheduler

EXAMPLES_PER_ROUTE = 20
FIELD_NAMES = sorted({name for m in vars(api).values()
                      if isinstance(m, type) and issubclass(m, BaseModel) and m is not BaseModel
                      for name in m.model_fields} | set(SamplingParams.model_fields))
SMALL_INTS = st.integers(-3, 40) | st.sampled_from([2**31, 2**63, -2**63, 10**30])
SCALARS = (st.none() | st.booleans() | SMALL_INTS | st.floats(allow_nan=True)
           | st.text(max_size=12) | st.sampled_from(["..", "/", "/etc", "\x00", "a" * 300]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), inner,
                                      max_size=5), max_leaves=12)
BODY = (st.dictionaries(st.sampled_from(FIELD_NAMES), JSON, max_size=6) | JSON)
RAW = st.binary(max_size=64)
CASES: dict[str, int] = {}


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    local = tmp_path_factory.mktemp("fuzz-local")
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32")
    sched = PagedScheduler(runner, max_running=4)
    cfg = ServeConfig(model=tiny_model_dir, enable_debug_endpoints=True,
                      local_checkpoint_dir=local, max_request_bytes=4096)
    sched.start()
    app = build_app(EngineState(cfg=cfg, runner=runner, scheduler=sched, started=time.monotonic()))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, local, tiny_model_dir
    sched.stop()


def routes(app) -> list[tuple[str, str]]:
    return sorted((m, r.path.replace("{model_id:path}", "x")) for r in app.routes
                  if isinstance(r, APIRoute) for m in r.methods if m != "HEAD")


def listing(path) -> list[str]:
    return sorted(str(p) for p in path.rglob("*"))


def check(client, method: str, path: str, **kw) -> None:
    r = client.request(method, path, **kw)
    assert r.status_code < 500, (method, path, kw, r.status_code, r.text[:300])
    assert "Traceback" not in r.text, (method, path, r.text[:300])
    # Leave the engine serving: a generated body may pause it or release its memory.
    if path == api.PAUSE_GENERATION:
        client.post(api.CONTINUE_GENERATION, json={})
    if path == api.RELEASE_MEMORY:
        client.post(api.RESUME_MEMORY, json={})
    assert client.get(api.HEALTH).status_code == 200


@pytest.mark.slow
def test_every_route_survives_generated_requests(engine):
    client, local, model = engine
    before = (listing(local), listing(model))
    table = routes(client.app)
    assert len(table) >= 20

    for method, path in table:
        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), database=None)
        @given(body=BODY, raw=RAW, use_raw=st.booleans())
        def one(body, raw, use_raw):
            CASES[path] = CASES.get(path, 0) + 1
            if method == "GET":
                check(client, method, path, params={"x": str(body)[:40]})
            elif use_raw:
                check(client, method, path, content=raw,
                      headers={"Content-Type": "application/json"})
            else:  # encoded here: the client refuses NaN and infinities, a server must not
                check(client, method, path, content=json.dumps(body),
                      headers={"Content-Type": "application/json"})

        one()
    ok = client.post(api.GENERATE, json={"text": "a", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200
    assert (listing(local), listing(model)) == before
    total = sum(CASES.values())
    print(f"\n{len(CASES)} routes, {total} generated requests")
    assert total >= len(table) * EXAMPLES_PER_ROUTE * 0.9
