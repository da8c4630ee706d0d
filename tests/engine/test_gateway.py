"""The real smg gateway (pip package `smg`) on loopback in front of two builtin engines:
/generate and chat through it; under consistent_hashing X-SMG-Routing-Key keeps a key on one
engine; when that engine dies its keys move and requests still succeed."""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from rltool.rollout.launch import start_engine
from rltool.supervisor import free_port, start

pytestmark = pytest.mark.slow


def output_tokens(engines: dict[str, str]) -> dict[str, int]:
    return {name: httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]
            ["total_output_tokens"] for name, url in engines.items()}


def generate(gateway: str, key: str, engines: dict[str, str] | None = None
             ) -> tuple[httpx.Response, str | None]:
    """One request through the gateway, and the name of the engine in `engines` that served it
    (the one whose output token count grew; requests run one at a time here)."""
    before = output_tokens(engines or {})
    rid = f"{key}-{uuid.uuid4().hex[:8]}"
    r = httpx.post(gateway + "/generate", headers={"X-SMG-Routing-Key": key}, timeout=60,
                   json={"input_ids": [5, 6, 7], "rid": rid,
                         "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    if not engines or r.status_code != 200:
        return r, None
    grew = [name for name, n in output_tokens(engines).items() if n > before[name]]
    assert len(grew) == 1, f"{rid} was decoded by {grew or 'no engine'}"
    return r, grew[0]


@pytest.fixture
def gateway(builtin_engine, tiny_model_dir, tmp_path):
    smg = shutil.which("smg", path=str(Path(sys.executable).parent))
    assert smg is not None, "the smg package (dev extra) must be installed"
    second = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir)],
                          log_path=tmp_path / "second.log", ready_timeout_s=120)
    port = free_port()
    proc = start([smg, "launch", "--host", "127.0.0.1", "--port", str(port),
                  "--worker-urls", builtin_engine.url, second.url,
                  "--policy", "consistent_hashing", "--prometheus-host", "127.0.0.1",
                  "--prometheus-port", str(free_port()),
                  "--health-check-interval-secs", "1",
                  "--health-failure-threshold", "1", "--log-level", "warn"],
                 log_path=tmp_path / "smg.log", name="smg gateway")
    url = f"http://127.0.0.1:{port}"

    def routes() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return generate(url, "warmup")[0].status_code == 200
        return False

    proc.wait_until(routes, timeout_s=60, what="routing requests", poll_s=0.5)
    yield url, {"first": builtin_engine.url, "second": second.url}, second
    proc.stop()
    second.stop()


def test_gateway_routes_keys_stickily_and_fails_over(gateway):
    url, engines, second = gateway
    placement: dict[str, str] = {}
    # keys until both engines hold some (8 keys all hash to one engine 1 time in 128)
    for i in range(64):
        key = f"session-{i}"
        r1, served1 = generate(url, key, engines)
        r2, served2 = generate(url, key, engines)
        assert r1.status_code == r2.status_code == 200
        placement[key] = served1
        assert served2 == placement[key]  # sticky
        if i >= 7 and set(placement.values()) == {"first", "second"}:
            break
    assert set(placement.values()) == {"first", "second"}, placement  # both engines used
    # smg (unlike SGLang) routes OpenAI requests by `model`: use the served name.
    served = httpx.get(engines["first"] + "/v1/models").json()["data"][0]["id"]
    chat = httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": served, "messages": [{"role": "user", "content": "ab"}],
                            "max_tokens": 3})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"

    second.stop()
    moved = [k for k, v in placement.items() if v == "second"]
    deadline = time.monotonic() + 60
    for key in moved:
        while True:
            try:
                r, served = generate(url, key, {"first": engines["first"]})
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{key} never moved to the surviving engine"
            time.sleep(0.5)
        assert served == "first"
