"""Health, readiness, load and information routes (read-only; /health* and /ready need no key)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from rltool.engine import api
from rltool.engine.routes.base import EngineState
from rltool.errors import EngineError

HEALTH_GENERATE_TIMEOUT_S = 20.0


def router(state: EngineState) -> APIRouter:
    r = APIRouter()
    link, cfg = state.link, state.cfg

    @r.get(api.HEALTH)
    async def health() -> Response:
        # Deliberately unlike SGLang: 200 while the engine lives, even paused or released, so a
        # supervisor does not restart an engine the trainer paused on purpose.
        return Response(status_code=200 if link.alive else 503)

    @r.get(api.READY)
    async def ready() -> Response:
        serving = link.alive and await link.call("readiness")
        return Response(status_code=200 if serving else 503)

    @r.get(api.LOADS)
    async def loads() -> dict[str, Any]:
        """smg's load polling (least_load / power_of_two policies)."""
        return {"loads": [await link.call("loads")]}

    async def generates() -> bool:
        body = api.GenerateInput(input_ids=[0], sampling_params={"max_new_tokens": 1,
                                                                 "temperature": 0.0})
        reqs, _ = state.expand(body)
        try:
            await asyncio.wait_for(state.run(reqs), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineError):
            return False
        return True

    probe: list[asyncio.Future | None] = [None]  # the one-token request in flight, if any

    @r.get(api.HEALTH_GENERATE)
    async def health_generate() -> Response:
        # It needs no key, so concurrent callers share one probe request: however many poll,
        # they hold at most one slot of the engine's queue.
        if probe[0] is None or probe[0].done():
            probe[0] = asyncio.ensure_future(generates())
        ok = await asyncio.shield(probe[0])
        return Response(status_code=200 if ok else 503)

    @r.get(api.MODEL_INFO)
    @r.get(api.MODEL_INFO_ALIAS)
    async def model_info() -> dict[str, Any]:
        return await state.model_info()

    @r.get(api.SERVER_INFO)
    @r.get(api.SERVER_INFO_ALIAS)
    async def server_info() -> dict[str, Any]:
        info = cfg.model_dump(mode="json", exclude={"api_key", "admin_api_key"})
        info.update(await link.call("engine_info"))
        info.update({
            "served_model_name": state.served_model_name,
            "tp_size": 1, "dp_size": 1,
            "frontend_process": state.cfg.uses_frontend_process,
            "version": _version(),
            "engine": "builtin",
            "uptime_s": time.monotonic() - state.started,
        })
        return info

    @r.get(api.WEIGHT_VERSION)
    @r.get(api.WEIGHT_VERSION_ALIAS)
    async def weight_version() -> dict[str, Any]:
        version = await link.call("weight_version")
        return api.WeightVersionInfo(weight_version=version).model_dump()

    return r


def _version() -> str:
    from rltool import __version__

    return __version__
