"""Scheduling, cache and memory control: /flush_cache, /pause_generation, /continue_generation,
/abort_request, /release_memory_occupation, /resume_memory_occupation. All admin routes."""

from __future__ import annotations

import asyncio
import time
from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from rltool.engine import api
from rltool.engine.routes.base import EngineState, parse_body
from rltool.engine.scheduler import MEMORY_TAGS
from rltool.engine.security import ADMIN
from rltool.errors import BadInputError

FLUSH_POLL_S = 0.05


def router(state: EngineState) -> APIRouter:
    r = APIRouter()
    link = state.link

    @r.api_route(api.FLUSH_CACHE, methods=["GET", "POST"], dependencies=[ADMIN])
    async def flush_cache(timeout: float = 0.0) -> Response:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            busy = await link.call("flush_if_idle")
            if not busy:
                return PlainTextResponse("Cache flushed.\nPlease check backend logs for more "
                                         "details. (When there are running or waiting requests, "
                                         "the operation will not be performed.)\n")
            if time.monotonic() >= deadline:
                return PlainTextResponse("Cache not flushed: requests are running or waiting.",
                                         status_code=400)
            await asyncio.sleep(FLUSH_POLL_S)

    @r.post(api.PAUSE_GENERATION, dependencies=[ADMIN])
    async def pause_generation(request: HttpRequest) -> dict:
        body = await parse_body(request, api.PauseInput)
        await link.call("pause", mode=body.mode)
        return api.ControlResult(message="Generation paused successfully.").model_dump()

    @r.post(api.CONTINUE_GENERATION, dependencies=[ADMIN])
    async def continue_generation(request: HttpRequest) -> dict:
        await parse_body(request, api.ContinueInput)
        await link.call("resume_generation")
        return api.ControlResult(message="Generation continued successfully.").model_dump()

    @r.post(api.ABORT_REQUEST, dependencies=[ADMIN])
    async def abort_request(request: HttpRequest) -> Response:
        body = await parse_body(request, api.AbortInput)
        await link.call("abort", rid=body.rid, abort_all=body.abort_all)
        return Response(status_code=200)

    async def memory_tags(request: HttpRequest) -> list[str]:
        body = await parse_body(request, api.MemoryInput, required=False)
        tags = list(MEMORY_TAGS) if body.tags is None else body.tags
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown:
            raise BadInputError(f"unknown memory tags {unknown}; use {list(MEMORY_TAGS)}")
        return tags

    @r.api_route(api.RELEASE_MEMORY, methods=["GET", "POST"], dependencies=[ADMIN])
    async def release_memory(request: HttpRequest) -> JSONResponse:
        await link.call("release_memory", tags=await memory_tags(request))
        return JSONResponse(None)

    @r.api_route(api.RESUME_MEMORY, methods=["GET", "POST"], dependencies=[ADMIN])
    async def resume_memory(request: HttpRequest) -> JSONResponse:
        tags = await memory_tags(request)
        if "weights" in tags:
            await link.call("resume_memory")
        return JSONResponse(None)

    return r
