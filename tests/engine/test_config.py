"""`rltool serve` refuses a reachable engine whose admin routes nobody guards."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from rltool.cli import main
from rltool.engine.config import ServeConfig, is_loopback


@pytest.fixture
def no_serving(monkeypatch):
    """Record instead of serving, so a command that gets past its checks returns at once."""
    calls = []
    monkeypatch.setattr("rltool.engine.server.serve", lambda cfg: calls.append(cfg))
    monkeypatch.setattr("rltool.rollout.sglang_server.serve_sglang", lambda cfg: calls.append(cfg))
    return calls


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "engine.example.com"])
@pytest.mark.parametrize("engine", ["builtin", "sglang"])
def test_serve_on_a_reachable_host_without_an_admin_key_is_refused(tiny_model_dir, no_serving,
                                                                    host, engine):
    """Regression: `rltool serve --host 0.0.0.0` without --admin-api-key served the weight,
    pause and memory routes to anyone who could reach the port (an --api-key alone opened them
    to every rollout client too)."""
    result = CliRunner().invoke(main, ["serve", "--engine", engine, "--model", str(tiny_model_dir),
                                       "--host", host, "--api-key", "user-key"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"--host {host}" in lines[0]
    assert "--admin-api-key" in lines[0] and "--allow-unauthenticated-admin" in lines[0]
    assert no_serving == []


def test_serve_on_a_reachable_host_runs_with_an_admin_key_or_the_deliberate_override(
        tiny_model_dir, no_serving):
    base = ["serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0"]
    for extra in (["--admin-api-key", "k"], ["--allow-unauthenticated-admin"]):
        result = CliRunner().invoke(main, base + extra)
        assert result.exit_code == 0, result.output
    assert [c.host for c in no_serving] == ["0.0.0.0", "0.0.0.0"]
    assert no_serving[1].allow_unauthenticated_admin is True


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.0.0.2", True),
                                           ("::1", True), ("[::1]", True), ("localhost", True),
                                           ("0.0.0.0", False), ("::", False),
                                           ("192.168.1.5", False), ("myhost", False)])
def test_loopback_hosts(host, loopback, tiny_model_dir):
    assert is_loopback(host) is loopback
    if loopback:  # the default case needs no key
        assert ServeConfig(model=tiny_model_dir, host=host).host == host
