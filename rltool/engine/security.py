"""Auth, request size limits and weight-path confinement for the builtin engine (SGLang's rules).

- `--api-key`: every route but `/health*`, `/ready` and `/metrics` needs `Authorization: Bearer`.
- `--admin-api-key`: weight, cache, pause, abort and memory routes need it instead (when unset they
  fall back to `--api-key`).
- Bodies larger than `--max-request-bytes` get 413 before they are read.
- Weight directories (`/update_weights_from_disk`, `/pull_weights`'s local directory) must lie
  under an allowed root: `--allowed-weight-root` (repeatable), by default the model's parent
  directory and `--local-checkpoint-dir`.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse

from rltool.errors import BadInputError

class PayloadTooLargeError(BadInputError):
    """A request body over --max-request-bytes (HTTP 413)."""


OPEN_PATHS = frozenset({"/health", "/health_generate", "/ready", "/metrics"})
ADMIN_PATHS = frozenset({
    "/update_weights_from_disk", "/pull_weights", "/update_weight_version", "/flush_cache",
    "/pause_generation", "/continue_generation", "/abort_request", "/release_memory_occupation",
    "/resume_memory_occupation", "/debug/hidden_states",
})


def accepted_keys(path: str, *, api_key: str | None, admin_api_key: str | None) -> list[str]:
    """Keys that open `path`; empty means the route is open. The admin key also opens the
    ordinary routes, so one client holding it can drive the whole engine."""
    if path in OPEN_PATHS:
        return []
    if path in ADMIN_PATHS and admin_api_key:
        return [admin_api_key]
    return [k for k in (api_key, admin_api_key if api_key else None) if k]


def check_auth(path: str, authorization: str | None, *, api_key: str | None,
               admin_api_key: str | None) -> JSONResponse | None:
    """None when allowed, else the 401 response."""
    keys = accepted_keys(path, api_key=api_key, admin_api_key=admin_api_key)
    if not keys:
        return None
    given = (authorization or "").removeprefix("Bearer ").strip().encode()
    if given and any(hmac.compare_digest(given, k.encode()) for k in keys):
        return None
    return JSONResponse({"error": {"message": "Unauthorized: send Authorization: Bearer <key>"}},
                        status_code=401)


def check_size(content_length: str | None, *, limit_bytes: int) -> JSONResponse | None:
    if content_length is None:
        return None
    try:
        size = int(content_length)
    except ValueError:
        return JSONResponse({"error": {"message": "invalid Content-Length"}}, status_code=400)
    if size > limit_bytes:
        return JSONResponse({"error": {"message": f"request body of {size} bytes exceeds the "
                                                  f"limit of {limit_bytes} bytes"}},
                            status_code=413)
    return None


class Guard:
    """Pure ASGI middleware applying `check_auth` and `check_size` before a route runs.

    Starlette's `@app.middleware("http")` (BaseHTTPMiddleware) re-wraps every request and response
    body in extra tasks and streams; on this engine's hot path that cost more per request than the
    route itself, so the guard is a plain ASGI callable instead.
    """

    def __init__(self, app: Any, *, api_key: str | None, admin_api_key: str | None,
                 max_request_bytes: int):
        self.app = app
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.lower(): v for k, v in scope["headers"] if k.lower() in
                       (b"authorization", b"content-length")}
            authorization = headers.get(b"authorization")
            length = headers.get(b"content-length")
            refused = (check_auth(scope["path"], authorization and authorization.decode("latin-1"),
                                  api_key=self.api_key, admin_api_key=self.admin_api_key)
                       or check_size(length and length.decode("latin-1"),
                                     limit_bytes=self.max_request_bytes))
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def confine(path: str, roots: list[Path], *, what: str) -> Path:
    """Resolve `path` and require it under one of `roots` (symlinks resolved first)."""
    resolved = Path(os.path.realpath(path))
    for root in roots:
        if resolved == root or root in resolved.parents:
            return resolved
    allowed = ", ".join(str(r) for r in roots) or "(none)"
    raise BadInputError(f"{what} {path} is outside the allowed weight roots ({allowed}); start "
                        "the engine with --allowed-weight-root DIR to allow it")
