"""POST /generate (SGLang's native generation route), plain or streamed as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rltool.engine import api
from rltool.engine.request import Request
from rltool.engine.routes.base import (EngineState, failure, failure_event, parse_body,
                                      runtime_error, sse_stream)


def router(state: EngineState) -> APIRouter:
    r = APIRouter()

    @r.api_route(api.GENERATE, methods=["POST", "PUT"])
    async def generate(request: HttpRequest) -> Response:
        body = await parse_body(request, api.GenerateInput)
        reqs, as_list = state.expand(body)
        if body.stream:
            events = _events(state, reqs, indexed=as_list)
            return StreamingResponse(sse_stream(events), media_type="text/event-stream")
        outs = await state.run(reqs, client=request)
        failed = failure(*outs)
        if failed is not None:
            return runtime_error(*failed)
        return JSONResponse(outs if as_list else outs[0])

    return r


async def _events(state: EngineState, reqs: list[Request], *,
                  indexed: bool) -> AsyncIterator[dict[str, Any]]:
    """SGLang's stream: a cumulative response per update (with its `index` in a batch or with
    `n > 1`); a request aborted with a status ends as an error event."""
    async for i, final, event in state.updates(reqs):
        if indexed:
            event["index"] = i
        failed = failure(event) if final else None
        yield event if failed is None else failure_event(*failed)

