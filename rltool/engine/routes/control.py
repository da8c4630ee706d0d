"""Scheduling, cache and memory control: /flush_cache, /pause_generation, /continue_generation,
/abort_request, /release_memory_occupation, /resume_memory_occupation. All admin routes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from rltool import trace
from rltool.engine import api
from rltool.engine.routes.base import EngineState, parse_body
from rltool.engine.scheduler import MEMORY_TAGS
from rltool.engine.security import ADMIN
from rltool.errors import BadInputError

FLUSH_POLL_S = 0.05


def _flush_if_idle(sched: Any) -> bool:
    """Empty the prefix cache unless requests are running or waiting; returns whether busy."""
    busy = bool(sched.running or sched.prefilling) or (bool(sched.waiting) and sched.paused is None)
    if not busy:
        sched.flush_cache()
    return busy


def router(state: EngineState) -> APIRouter:
    r = APIRouter()
    sched, runner = state.scheduler, state.runner

    @r.api_route(api.FLUSH_CACHE, methods=["GET", "POST"], dependencies=[ADMIN])
    async def flush_cache(timeout: float = 0.0) -> Response:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            busy = await state.on_thread(lambda: _flush_if_idle(sched))
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
        await state.on_thread(lambda: sched.pause(body.mode))
        return api.ControlResult(message="Generation paused successfully.").model_dump()

    @r.post(api.CONTINUE_GENERATION, dependencies=[ADMIN])
    async def continue_generation(request: HttpRequest) -> dict:
        await parse_body(request, api.ContinueInput)
        await state.on_thread(sched.resume_generation)
        return api.ControlResult(message="Generation continued successfully.").model_dump()

    @r.post(api.ABORT_REQUEST, dependencies=[ADMIN])
    async def abort_request(request: HttpRequest) -> Response:
        body = await parse_body(request, api.AbortInput)
        await state.on_thread(lambda: sched.abort(rid=body.rid, abort_all=body.abort_all))
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
        tags = await memory_tags(request)

        def release() -> None:
            sched.retract_for_release()  # KV is per request: dropping it means recompute later
            if "weights" in tags:
                runner.release()

        with trace.span("offload", cat="memory"):
            await state.on_thread(release)
        return JSONResponse(None)

    @r.api_route(api.RESUME_MEMORY, methods=["GET", "POST"], dependencies=[ADMIN])
    async def resume_memory(request: HttpRequest) -> JSONResponse:
        tags = await memory_tags(request)
        if "weights" in tags:
            with trace.span("reload", cat="memory"):
                await state.on_thread(runner.resume)
        return JSONResponse(None)

    return r
