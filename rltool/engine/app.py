"""The builtin engine's HTTP routes (SGLang-native names and shapes; engine-http-api.md).

Handlers run on the event loop and never touch the model: generation requests go to the
scheduler thread with completion callbacks, control operations run on that thread through
`Scheduler.call`. Errors: a body that fails validation gets 400 in SGLang's OpenAI-style error
object; a runtime refusal gets 400 `{"error": {"message": ...}}`; a full queue gets 429.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from rltool.errors import BadInputError, EngineError
from rltool.engine.config import ServeConfig
from rltool.engine.model_runner import ModelRunner
from rltool.engine.openai import register_openai_routes
from rltool.engine.api import (AbortInput, ContinueInput, GenerateInput,
                                            MemoryInput, PauseInput,
                                            PullWeightsInput, UpdateWeightsFromDiskInput,
                                            UpdateWeightVersionInput, expand_generate)
from rltool.engine.request import Request, build_response
from rltool.engine.scheduler import MEMORY_TAGS, QueueFullError, Scheduler
from rltool.engine.security import Guard, PayloadTooLargeError, confine

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
HEALTH_GENERATE_TIMEOUT_S = 20.0
FLUSH_POLL_S = 0.05


@dataclass
class EngineState:
    cfg: ServeConfig
    runner: ModelRunner
    scheduler: Scheduler
    started: float  # time.monotonic() at start
    started_wall_s: float = field(default_factory=time.time)


def validation_error(message: str) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "type": "Bad Request",
                         "param": None, "code": 400}, status_code=400)


def runtime_error(message: str, status_code: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status_code)


async def parse_body(request: HttpRequest, model: type[M], *, required: bool = True) -> M:
    limit = request.app.state.engine.cfg.max_request_bytes
    parts, size = [], 0
    async for chunk in request.stream():  # bounded even without a Content-Length header
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
    raw = b"".join(parts)
    if not raw.strip():
        if required:
            raise RequestValidationError([{"msg": "a JSON body is required ({} works)"}])
        data: Any = {}
    else:
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise RequestValidationError([{"msg": f"body is not valid JSON: {e}"}]) from e
    if not isinstance(data, dict):
        raise RequestValidationError([{"msg": "body must be a JSON object"}])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e


def _describe(errors: Any) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts)


def build_app(state: EngineState) -> FastAPI:
    app = FastAPI(title="rltool builtin engine", docs_url=None, redoc_url=None)
    app.state.engine = state
    sched, runner = state.scheduler, state.runner
    cfg = state.cfg
    weight_roots = cfg.weight_roots()

    app.add_middleware(Guard, api_key=cfg.api_key, admin_api_key=cfg.admin_api_key,
                       max_request_bytes=cfg.max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        return validation_error(_describe(exc.errors()))

    # Most specific first: Starlette picks the handler of the nearest class in the MRO.
    for exc_type, status in ((QueueFullError, 429), (PayloadTooLargeError, 413),
                             (BadInputError, 400), (EngineError, 503)):
        app.add_exception_handler(exc_type, _status_handler(status))

    @app.exception_handler(Exception)
    async def _on_unexpected(request: HttpRequest, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return runtime_error(f"internal error: {type(exc).__name__}: {exc}", 500)

    async def on_thread(fn: Any) -> Any:
        return await asyncio.wrap_future(sched.call(fn))

    # ----- generation ------------------------------------------------------------------------

    def expand(body: GenerateInput) -> tuple[list[Request], bool]:
        try:
            return expand_generate(body, tokenizer=runner.tokenizer,
                                   context_length=runner.context_length,
                                   vocab_size=runner.vocab_size,
                                   deterministic=state.cfg.deterministic)
        except ValidationError as e:  # sampling_params
            raise BadInputError(_describe(e.errors())) from e

    def respond(req: Request) -> dict[str, Any]:
        return build_response(req, tokenizer=runner.tokenizer,
                              weight_version=runner.weight_version)

    async def run_requests(reqs: list[Request]) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in reqs]
        for req, fut in zip(reqs, futures):
            req.on_finish = (lambda r, f=fut: loop.call_soon_threadsafe(
                _resolve, f, respond(r)))
        sched.submit(reqs)
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:  # client went away: free the engine
            rids = [r.rid for r in reqs]
            sched.call(lambda: [sched.abort(rid=rid) for rid in rids])
            raise

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: HttpRequest) -> Response:
        body = await parse_body(request, GenerateInput)
        reqs, as_list = expand(body)
        if body.stream:
            return StreamingResponse(stream_events(reqs, indexed=as_list),
                                     media_type="text/event-stream")
        outs = await run_requests(reqs)
        for out in outs:
            reason = out["meta_info"]["finish_reason"] or {}
            if reason.get("type") == "abort" and reason.get("status_code"):
                return runtime_error(reason["message"], int(reason["status_code"]))
        return JSONResponse(outs if as_list else outs[0])

    async def updates(reqs: list[Request]) -> AsyncIterator[tuple[int, bool, dict[str, Any]]]:
        """Submit `reqs`; yield (index, finished, cumulative response) after every new token.
        Raises QueueFullError / BadInputError / EngineError if the scheduler refuses them."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        for i, req in enumerate(reqs):
            req.on_token = (lambda r, i=i: loop.call_soon_threadsafe(
                queue.put_nowait, (i, False, respond(r))))
            req.on_finish = (lambda r, i=i: loop.call_soon_threadsafe(
                queue.put_nowait, (i, True, respond(r))))
        sched.submit(reqs)
        remaining = len(reqs)
        try:
            while remaining:
                i, final, event = await queue.get()
                remaining -= final
                yield i, final, event
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            rids = [r.rid for r in reqs]
            sched.call(lambda: [sched.abort(rid=rid) for rid in rids])
            raise

    async def stream_events(reqs: list[Request], *, indexed: bool) -> AsyncIterator[bytes]:
        """SGLang's SSE: cumulative events, `data: [DONE]` last, errors as events."""
        try:
            async for i, final, event in updates(reqs):
                if indexed:
                    event["index"] = i
                reason = event["meta_info"]["finish_reason"] or {}
                if final and reason.get("type") == "abort" and reason.get("status_code"):
                    event = {"error": {"message": reason["message"], "type": "server_error",
                                       "code": reason["status_code"], "retryable": True}}
                yield _sse(event)
        except (BadInputError, EngineError) as e:
            code = 429 if isinstance(e, QueueFullError) else 400
            yield _sse({"error": {"message": str(e), "type": "invalid_request_error",
                                  "code": code, "retryable": code == 429}})
        yield b"data: [DONE]\n\n"

    register_openai_routes(app, state=state, expand=expand, run=run_requests, updates=updates)

    # ----- health and info -------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        # Deliberate difference (DESIGN.md): 200 while the engine lives, even paused or released.
        return Response(status_code=200 if sched.alive else 503)

    @app.get("/ready")
    async def ready() -> Response:
        serving = sched.alive and sched.paused is None and not runner.released
        return Response(status_code=200 if serving else 503)

    @app.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        """smg's load polling (least_load / power_of_two policies)."""
        st = sched.stats()
        return {"loads": [{"dp_rank": 0, "num_running_reqs": st["num_running_reqs"],
                           "num_waiting_reqs": st["num_waiting_reqs"],
                           "token_usage": st["num_running_reqs"] / state.cfg.max_running_requests,
                           "gen_throughput": st["gen_throughput"]}]}

    @app.get("/health_generate")
    async def health_generate() -> Response:
        body = GenerateInput(input_ids=[0], sampling_params={"max_new_tokens": 1,
                                                             "temperature": 0.0})
        reqs, _ = expand(body)
        try:
            await asyncio.wait_for(run_requests(reqs), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        info = runner.model_info()
        info["served_model_name"] = state.cfg.served_model_name or str(state.cfg.model)
        return info

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        info = state.cfg.model_dump(mode="json")
        info.update({
            "model_path": str(runner.model_path),
            "served_model_name": state.cfg.served_model_name or str(state.cfg.model),
            "tp_size": 1, "dp_size": 1,
            "context_length": runner.context_length,
            "max_total_num_tokens": runner.context_length * state.cfg.max_running_requests,
            "max_req_input_len": runner.context_length - 1,
            "weight_version": runner.weight_version,
            "internal_states": [sched.stats()],
            "version": _version(),
            "engine": "builtin",
            "uptime_s": time.monotonic() - state.started,
        })
        return info

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": runner.weight_version}

    # ----- cache, scheduling, memory ---------------------------------------------------------

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0) -> Response:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            busy = await on_thread(lambda: bool(sched.running or sched.prefilling)
                                   or (bool(sched.waiting) and sched.paused is None))
            if not busy:
                return PlainTextResponse("Cache flushed.\nPlease check backend logs for more "
                                         "details. (When there are running or waiting requests, "
                                         "the operation will not be performed.)\n")
            if time.monotonic() >= deadline:
                return PlainTextResponse("Cache not flushed: requests are running or waiting.",
                                         status_code=400)
            await asyncio.sleep(FLUSH_POLL_S)

    @app.post("/pause_generation")
    async def pause_generation(request: HttpRequest) -> dict[str, str]:
        body = await parse_body(request, PauseInput)
        await on_thread(lambda: sched.pause(body.mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: HttpRequest) -> dict[str, str]:
        await parse_body(request, ContinueInput)
        await on_thread(sched.resume_generation)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(request: HttpRequest) -> Response:
        body = await parse_body(request, AbortInput)
        await on_thread(lambda: sched.abort(rid=body.rid, abort_all=body.abort_all))
        return Response(status_code=200)

    async def memory_body(request: HttpRequest) -> list[str]:
        body = await parse_body(request, MemoryInput, required=False)
        tags = list(MEMORY_TAGS) if body.tags is None else body.tags
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown:
            raise BadInputError(f"unknown memory tags {unknown}; use {list(MEMORY_TAGS)}")
        return tags

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory(request: HttpRequest) -> JSONResponse:
        tags = await memory_body(request)

        def release() -> None:
            sched.retract_for_release()  # KV is per request: dropping it means recompute later
            if "weights" in tags:
                runner.release()

        await on_thread(release)
        return JSONResponse(None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory(request: HttpRequest) -> JSONResponse:
        tags = await memory_body(request)
        if "weights" in tags:
            await on_thread(runner.resume)
        return JSONResponse(None)

    # ----- weights ---------------------------------------------------------------------------

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: HttpRequest) -> JSONResponse:
        body = await parse_body(request, UpdateWeightsFromDiskInput)

        try:
            path = confine(body.model_path, weight_roots, what="model_path")
        except BadInputError as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0},
                                status_code=400)

        def apply() -> int:
            paused = len(sched.running) + len(sched.prefilling) if sched.paused else 0
            runner.load_weights(path)
            if body.weight_version is not None:
                runner.weight_version = body.weight_version
            return paused

        try:
            paused = await asyncio.wrap_future(
                sched.update_weights(apply, abort_all=body.abort_all_requests))
        except (BadInputError, EngineError) as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0},
                                status_code=400)
        message = "Succeeded to update model weights."
        if body.weight_version is not None:
            message += f" Weight version updated to {body.weight_version}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": paused})

    @app.post("/update_weight_version")
    async def update_weight_version(request: HttpRequest) -> JSONResponse:
        body = await parse_body(request, UpdateWeightVersionInput)
        if body.abort_all_requests:
            await on_thread(lambda: sched.abort(abort_all=True))
        version = body.new_version

        def set_version() -> None:
            runner.weight_version = version

        await on_thread(set_version)
        return JSONResponse({"success": True, "message": "Weight version updated.",
                             "new_version": version})

    @app.post("/pull_weights")
    async def pull_weights(request: HttpRequest) -> JSONResponse:
        body = await parse_body(request, PullWeightsInput)
        try:
            confine(body.local_checkpoint_dir, weight_roots, what="local_checkpoint_dir")
            result = await asyncio.to_thread(_pull_weights, body, base_model_path=state.cfg.model)
        except (BadInputError, OSError) as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        # SGLang's shape ({success, message: str}) plus what was synced.
        return JSONResponse({"success": True, "message": "Success.", "pull": result})

    return app


def _pull_weights(body: PullWeightsInput, *, base_model_path: Any) -> dict[str, Any]:
    """slime's /pull_weights: sync files only (the caller then sends /update_weights_from_disk).
    Version 0 is the engine's own --model when the source has no weight_v000000."""
    from pathlib import Path

    from rltool.delta.pull import pull_weights

    return pull_weights(local_checkpoint_dir=Path(body.local_checkpoint_dir),
                        source_dir=Path(body.source_dir), target_version=body.target_version,
                        base_model_path=base_model_path)


def _status_handler(status: int) -> Any:
    async def handler(request: HttpRequest, exc: Exception) -> JSONResponse:
        return runtime_error(str(exc), status)

    return handler


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _version() -> str:
    from rltool import __version__

    return __version__
