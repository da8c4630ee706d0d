"""The builtin engine's OpenAI routes: /v1/models, /v1/completions, /v1/chat/completions.

A handler parses its body (openai_bodies), translates it into a /generate body and from there
takes /generate's path: `EngineState.expand`, then `EngineState.run` or, streamed,
`EngineState.updates` framed by `sse_stream`. The native results are reshaped into OpenAI's
objects (openai_shapes). Errors use OpenAI's `{"object":"error",...}` object (a duplicate
request id 400, a request the engine failed its status, as on /generate), except a body over
the size limit (413 in the engine's plain error, as on every route); in streams they arrive as
`data: {"error": {...}}` followed by `data: [DONE]`, a full queue with code 429 as on /generate.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rltool.engine import api
from rltool.engine.request import Request
from rltool.engine.routes.base import (EngineState, failure, failure_event, openai_error,
                                      read_body, sse_stream)
from rltool.engine.routes.openai_bodies import (ChatRequest, CompletionRequest, OpenAIRequest,
                                                parse_request)
from rltool.engine.routes.openai_shapes import ChatShape, CompletionShape, Shape, usage
from rltool.engine.scheduler import QueueFullError
from rltool.errors import BadInputError, EngineError


def router(state: EngineState) -> APIRouter:
    routes = OpenAIRoutes(state)
    r = APIRouter()
    r.add_api_route(api.OPENAI_MODELS, routes.models, methods=["GET"])
    r.add_api_route(api.OPENAI_MODELS + "/{model_id:path}", routes.model, methods=["GET"])
    r.add_api_route(api.OPENAI_COMPLETIONS, routes.completions, methods=["POST"])
    r.add_api_route(api.OPENAI_CHAT_COMPLETIONS, routes.chat, methods=["POST"])
    return r


class OpenAIRoutes:
    """The handlers, bound to one engine's state."""

    def __init__(self, state: EngineState):
        self.state = state

    # ----- /v1/models ------------------------------------------------------------------------

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.card()]}

    async def model(self, model_id: str) -> JSONResponse:
        if model_id != self.state.served_model_name:
            return JSONResponse({"error": {"message": f"model {model_id!r} not found",
                                           "type": "invalid_request_error", "param": None,
                                           "code": "model_not_found"}}, status_code=404)
        return JSONResponse(self.card())

    def card(self) -> dict[str, Any]:
        served = self.state.served_model_name
        return {"id": served, "object": "model", "created": int(self.state.started_wall_s),
                "owned_by": "sglang", "root": served, "parent": None,
                "max_model_len": self.state.info.context_length}

    # ----- generation ------------------------------------------------------------------------

    async def completions(self, request: HttpRequest) -> Response:
        raw = await read_body(request)
        try:
            body = parse_request(request, raw, CompletionRequest)
        except BadInputError as e:
            return openai_error(str(e))
        tokenizer = self.state.info.tokenizer
        prompt_texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in body.prompts]
        shape = CompletionShape(tokenizer, body=body, prompt_texts=prompt_texts)
        return await self.answer(request, body, body.to_generate(), shape)

    async def chat(self, request: HttpRequest) -> Response:
        info = self.state.info
        raw = await read_body(request)
        try:
            body = parse_request(request, raw, ChatRequest)
            body.check_supported()
            prompt_ids = body.prompt_ids(info.tokenizer)
        except BadInputError as e:
            return openai_error(str(e))
        generate = body.to_generate(prompt_ids, context_length=min(info.context_length,
                                                                   info.max_total_num_tokens))
        return await self.answer(request, body, generate, ChatShape(info.tokenizer, body=body))

    async def answer(self, request: HttpRequest, body: OpenAIRequest,
                     generate: api.GenerateInput, shape: Shape) -> Response:
        """Expand and run `generate` as /generate does; the whole answer, or its stream."""
        state = self.state
        try:
            reqs, _ = state.expand(generate)
        except BadInputError as e:
            return openai_error(str(e))
        head = {"id": f"{shape.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": body.model or state.served_model_name}
        if body.stream:
            events = stream_chunks(state, reqs, body=body, head=head, shape=shape)
            return StreamingResponse(sse_stream(events), media_type="text/event-stream")
        try:
            outs = await state.run(reqs, client=request)
        except BadInputError as e:  # the scheduler's refusal: a duplicate request id, ...
            return openai_error(str(e))
        except EngineError as e:
            return openai_error(str(e), 429 if isinstance(e, QueueFullError) else 503)
        failed = failure(*outs)
        if failed is not None:
            return openai_error(*failed)
        return JSONResponse({**head, "object": shape.object,
                             "choices": [shape.choice(i, out) for i, out in enumerate(outs)],
                             "usage": usage(outs, body.n),
                             "metadata": {"weight_version": state.weight_version}})


async def stream_chunks(state: EngineState, reqs: list[Request], *, body: OpenAIRequest,
                        head: dict[str, Any], shape: Shape) -> AsyncIterator[dict[str, Any]]:
    """A chunk per update of a choice, holding the text and tokens new since its last chunk (an
    error event in place of the last one of a choice the engine failed); with
    `stream_options.include_usage`, a last chunk with the usage and no choices."""
    sent: dict[int, tuple[str, int]] = {}  # index -> (text sent, tokens sent)
    finals: dict[int, dict[str, Any]] = {}
    async for i, final, out in state.updates(reqs):
        if final:
            finals[i] = out
            failed = failure(out)
            if failed is not None:
                yield failure_event(*failed)
                continue
        text_sent, toks_sent = sent.get(i, ("", 0))
        text = out["text"]
        delta = text[len(text_sent):] if text.startswith(text_sent) else ""
        yield {**head, **shape.chunk(i, out, delta, toks_sent, first=i not in sent)}
        sent[i] = (text_sent + delta, len(out["output_ids"]))
    if body.include_usage:
        outs = [finals[i] for i in sorted(finals)]
        yield {**head, "object": shape.chunk_object, "choices": [], "usage": usage(outs, body.n)}

