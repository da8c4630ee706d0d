"""POST /generate (SGLang's native generation route), plain or streamed as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rltool.engine import api
from rltool.engine.request import Request
from rltool.engine.routes.base import EngineState, parse_body, runtime_error, sse_stream


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
        for out in outs:
            reason = out["meta_info"]["finish_reason"] or {}
            if reason.get("type") == "abort" and reason.get("status_code"):
                return runtime_error(reason["message"], int(reason["status_code"]))
        return JSONResponse(outs if as_list else outs[0])

    return r


async def _events(state: EngineState, reqs: list[Request], *,
                  indexed: bool) -> AsyncIterator[dict[str, Any]]:
    """SGLang's stream: a cumulative response per update (with its `index` in a batch or with
    `n > 1`); a request aborted with a status ends as an error event."""
    async for i, final, event in state.updates(reqs):
        if indexed:
            event["index"] = i
        reason = event["meta_info"]["finish_reason"] or {}
        if final and reason.get("type") == "abort" and reason.get("status_code"):
            event = {"error": {"message": reason["message"], "type": "server_error",
                               "code": reason["status_code"], "retryable": True}}
        yield event

