"""EngineClient against dead / silent / flaky endpoints, the launcher's failure path, and the
`rltool serve` command's input checks."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from click.testing import CliRunner

from rltool.cli import main
from rltool.errors import EngineError, EngineTimeoutError
from rltool.rollout import client as client_mod
from rltool.rollout.client import EngineClient
from rltool.rollout.launch import start_engine
from rltool.supervisor import free_port


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(client_mod, "BACKOFF_BASE_S", 0.01)


def counting_requests(client: EngineClient) -> list[str]:
    """The HTTP requests `client` sends (one entry per attempt, retries included)."""
    attempts: list[str] = []
    send = client._http.request

    async def request(method, path, **kwargs):
        attempts.append(f"{method} {path}")
        return await send(method, path, **kwargs)

    client._http.request = request
    return attempts


def test_dead_port_errors_after_its_retries(fast_backoff):
    """A dead port fails with EngineError after max_retries retries of the connection, then gives
    up instead of retrying forever. Checked by counting the attempts, not by timing the call."""
    url = f"http://127.0.0.1:{free_port()}"

    async def main():
        async with EngineClient(url, max_retries=2, connect_timeout_s=1.0) as c:
            assert await c.health() is False
            attempts = counting_requests(c)
            with pytest.raises(EngineError) as err:
                await c.generate({"text": "a"})
            return err.value, attempts

    err, attempts = asyncio.run(main())
    assert "cannot reach the engine" in str(err) and err.status_code is None
    assert attempts == ["POST /generate"] * 3  # the first try and 2 retries


def test_silent_server_times_out_instead_of_hanging():
    """A server that accepts the connection and never answers makes the call fail with
    EngineTimeoutError after one attempt (a timeout is not retried: the engine may still be
    working on it). Checked by the error and the attempt count, not by timing the call: the
    server never answers, so only the client's timeout can end it (pytest's timeout bounds a
    hang)."""
    with socket.socket() as listener:  # accepts connections (backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"

        async def main():
            async with EngineClient(url, timeout_s=0.5, max_retries=3) as c:
                attempts = counting_requests(c)
                with pytest.raises(EngineTimeoutError, match="no answer within the timeout"):
                    await c.generate({"text": "a"})
                return attempts

        assert asyncio.run(main()) == ["POST /generate"]


def flaky_client(statuses: list[int], seen: list[httpx.Request], **kwargs) -> EngineClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        code = statuses[min(len(seen) - 1, len(statuses) - 1)]
        body = {"text": "ok"} if code == 200 else {"error": {"message": f"status {code}"}}
        return httpx.Response(code, json=body)

    c = EngineClient("http://engine", **kwargs)
    c._http = httpx.AsyncClient(base_url="http://engine", transport=httpx.MockTransport(handler))
    return c


def test_transient_statuses_are_retried_then_succeed(fast_backoff):
    seen: list[httpx.Request] = []

    async def main():
        async with flaky_client([503, 429, 502, 200], seen, max_retries=3) as c:
            return await c.generate({"text": "a"}, routing_key="session-7")

    assert asyncio.run(main()) == {"text": "ok"}
    assert len(seen) == 4
    assert all(r.headers["X-SMG-Routing-Key"] == "session-7" for r in seen)


@pytest.mark.parametrize("statuses,calls,code", [([400], 1, 400), ([500], 1, 500),
                                                 ([429], 3, 429), ([504], 3, 504)])
def test_errors_carry_status_and_only_transient_ones_retry(fast_backoff, statuses, calls, code):
    seen: list[httpx.Request] = []

    async def main():
        async with flaky_client(statuses, seen, max_retries=2) as c:
            with pytest.raises(EngineError) as err:
                await c.update_weights_from_disk("/x")
            return err.value

    err = asyncio.run(main())
    assert err.status_code == code and f"status {code}" in str(err)
    assert len(seen) == calls


def test_start_engine_reports_an_early_death_with_the_log_tail(tmp_path):
    with pytest.raises(EngineError) as err:
        start_engine(["--model", str(tmp_path / "missing")], log_path=tmp_path / "engine.log",
                     ready_timeout_s=60)
    assert "exited with code 2" in str(err.value) and "config.json" in str(err.value)


def test_serve_command_rejects_bad_input(tmp_path):
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path)])
    assert result.exit_code == 2 and "not a HF checkpoint directory" in result.output
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--port", "-1"])
    assert result.exit_code == 2 and "--port" in result.output
    help_ = CliRunner().invoke(main, ["serve", "--help"])
    assert help_.exit_code == 0 and "Example:" in help_.output and "--deterministic" in help_.output


def test_collective_weight_sync_calls_are_never_sent_twice(fast_backoff):
    """A 504 (the rendezvous timed out) or 503 answer to a collective call is not retried: rank 0
    joins once, and a repeat would wait for a broadcast that never comes."""
    for call, kwargs in (("init_weights_update_group",
                          {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                           "world_size": 2}),
                         ("update_weights_from_distributed",
                          {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]})):
        seen: list[httpx.Request] = []

        async def main():
            async with flaky_client([504, 200], seen, max_retries=3) as c:
                await getattr(c, call)(**kwargs)

        with pytest.raises(EngineError, match="answered 504"):
            asyncio.run(main())
        assert len(seen) == 1, call
