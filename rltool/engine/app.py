"""The builtin engine's FastAPI app: routers grouped by concern (rltool.engine.routes), the
`Guard` middleware (Host, Origin, API key, Content-Type, body size) and the error shapes.

Route names and shapes are SGLang's (rltool.engine.api, docs/engine-api.md). Errors: a body that
fails validation gets 400 in SGLang's OpenAI-style error object; a runtime refusal gets
`{"error": {"message": ...}}` with 400 (bad input), 401 (missing key), 403 (a web page of another
origin), 413 (body too large), 415 (a body that is not JSON), 421 (a Host that is not the
engine's), 429 (queue full) or 503 (engine unavailable).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rltool.engine.routes import (control, debug, generate, info, lora, openai, transfer,
                                  weights)
from rltool.engine.routes.base import EngineState, describe_errors, openai_error, runtime_error
from rltool.engine.scheduler import QueueFullError
from rltool.engine.security import (Guard, HostCheck, PayloadTooLargeError, UnauthorizedError,
                                    admin_paths)
from rltool.errors import BadInputError, EngineError

log = logging.getLogger(__name__)

__all__ = ["EngineState", "build_app"]


def build_app(state: EngineState) -> FastAPI:
    cfg = state.cfg
    app = FastAPI(title="rltool builtin engine", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine = state

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        return openai_error(describe_errors(exc.errors()))

    # Starlette picks the handler of the nearest class in the exception's MRO.
    for exc_type, status in ((QueueFullError, 429), (PayloadTooLargeError, 413),
                             (UnauthorizedError, 401), (BadInputError, 400), (EngineError, 503)):
        app.add_exception_handler(exc_type, _status_handler(status))

    @app.exception_handler(Exception)
    async def _on_unexpected(request: HttpRequest, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return runtime_error(f"internal error: {type(exc).__name__}: {exc}", 500)

    # Hot routes first: matching is linear.
    groups = [generate, openai, info, control, weights, transfer, lora]
    if cfg.enable_debug_endpoints:  # rltool align-gate --layerwise (docs/align.md)
        groups.append(debug)
    for group in groups:
        # The routers' routes go straight into the app's table. `include_router` would route
        # every request through a lazily built wrapper per router, which cost 20-40% more per
        # request than a flat table in a routing micro-benchmark.
        app.router.routes.extend(group.router(state).routes)
    # Added once the routes are in: the guard refuses cross-origin requests to the admin paths
    # whatever the method, so it needs their list.
    app.add_middleware(Guard, api_key=cfg.api_key, admin_api_key=cfg.admin_api_key,
                       max_request_bytes=cfg.max_request_bytes,
                       hosts=HostCheck(bind_host=cfg.host, allowed_hosts=cfg.allowed_hosts),
                       admin_paths=admin_paths(app.routes))
    return app


def _status_handler(status: int) -> Any:
    async def handler(request: HttpRequest, exc: Exception) -> JSONResponse:
        return runtime_error(str(exc), status)

    return handler
