"""Calling a live engine from synchronous tests."""

from __future__ import annotations

import asyncio

from rltool.rollout.client import EngineClient


def engine_call(url: str, method: str, *args, **kwargs):
    """Run one EngineClient coroutine method against `url` (a fresh client per call)."""

    async def go():
        async with EngineClient(url, timeout_s=60.0, max_retries=0) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(go())
