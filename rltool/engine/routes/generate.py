"""POST /generate (SGLang's native generation route), plain or streamed as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rltool.engine import api
from rltool.engine.request import Request
from rltool.engine.routes.base import EngineState, parse_body, runtime_error, sse
from rltool.engine.scheduler import QueueFullError
from rltool.errors import BadInputError, EngineError


def router(state: EngineState) -> APIRouter:
    r = APIRouter()

    @r.api_route(api.GENERATE, methods=["POST", "PUT"])
    async def generate(request: HttpRequest) -> Response:
        body = await parse_body(request, api.GenerateInput)
        reqs, as_list = state.expand(body)
        if body.stream:
            return StreamingResponse(stream_events(state, reqs, indexed=as_list),
                                     media_type="text/event-stream")
        outs = await state.run(reqs)
        for out in outs:
            reason = out["meta_info"]["finish_reason"] or {}
            if reason.get("type") == "abort" and reason.get("status_code"):
                return runtime_error(reason["message"], int(reason["status_code"]))
        return JSONResponse(outs if as_list else outs[0])

    return r


async def stream_events(state: EngineState, reqs: list[Request], *,
                        indexed: bool) -> AsyncIterator[bytes]:
    """SGLang's SSE: cumulative events, `data: [DONE]` last, errors as events."""
    try:
        async for i, final, event in state.updates(reqs):
            if indexed:
                event["index"] = i
            reason = event["meta_info"]["finish_reason"] or {}
            if final and reason.get("type") == "abort" and reason.get("status_code"):
                event = {"error": {"message": reason["message"], "type": "server_error",
                                   "code": reason["status_code"], "retryable": True}}
            yield sse(event)
    except (BadInputError, EngineError) as e:
        code = 429 if isinstance(e, QueueFullError) else 400
        yield sse({"error": {"message": str(e), "type": "invalid_request_error",
                             "code": code, "retryable": code == 429}})
    yield b"data: [DONE]\n\n"
