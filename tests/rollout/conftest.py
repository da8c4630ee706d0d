"""Fixtures for the builtin engine tests: a deterministic engine these tests may pause, re-weight
and finally shut down (the session-wide `builtin_engine` in tests/conftest.py stays untouched)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rltool.rollout.client import EngineClient
from rltool.rollout.launch import start_engine


def engine_call(url: str, method: str, *args, **kwargs):
    """Run one EngineClient coroutine method against `url` (a fresh client per call)."""

    async def go():
        async with EngineClient(url, timeout_s=60.0, max_retries=0) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def det_engine(tiny_model_dir, tmp_path_factory):
    log_path: Path = tmp_path_factory.mktemp("engine-logs") / "det.log"
    proc = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir), "--deterministic",
                         "--max-running-requests", "16", "--max-queued-requests", "64",
                         "--max-prefill-tokens", "8", "--weight-version", "0",
                         "--allowed-weight-root", str(tmp_path_factory.getbasetemp())],
                        log_path=log_path, ready_timeout_s=120.0)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def other_weights_dir(tiny_model_factory):
    """Same shapes as tiny_model_dir, different values (seed 1)."""
    return tiny_model_factory("qwen2", 1)
