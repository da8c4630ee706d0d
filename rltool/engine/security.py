"""Auth, request size limits and path confinement for the builtin engine.

- `--api-key`: every route but the open ones (`api.OPEN_PATHS`: `/health*`, `/ready`, `/metrics`)
  needs `Authorization: Bearer <key>`; checked by `Guard`, a plain ASGI middleware.
- `--admin-api-key`: routes that change the engine's state are marked where they are defined with
  the `ADMIN` dependency, which then asks for this key (without it they fall back to `--api-key`).
  The admin key also opens the ordinary routes, so one client holding it can drive the engine.
- Bodies larger than `--max-request-bytes` get 413 before they are read.
- Weight paths (`/update_weights_from_disk`'s model_path, `/pull_weights`'s source_dir) must lie
  under an allowed root (`ServeConfig.weight_roots`); `/pull_weights` writes only into
  `--local-checkpoint-dir` or a directory under it (`confine_local`). Symlinks are resolved first.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any

from fastapi import Depends, Request as HttpRequest
from fastapi.responses import JSONResponse

from rltool.engine.api import OPEN_PATHS
from rltool.errors import BadInputError

UNAUTHORIZED = {"error": {"message": "Unauthorized: send Authorization: Bearer <key>"}}


class PayloadTooLargeError(BadInputError):
    """A request body over --max-request-bytes (HTTP 413)."""


class UnauthorizedError(BadInputError):
    """A request without the key its route needs (HTTP 401)."""


def key_matches(authorization: str | None, keys: list[str]) -> bool:
    given = (authorization or "").removeprefix("Bearer ").strip().encode()
    return bool(given) and any(hmac.compare_digest(given, k.encode()) for k in keys)


def accepted_keys(path: str, *, api_key: str | None, admin_api_key: str | None) -> list[str]:
    """Keys the middleware accepts for `path`; empty means it lets the request through. Admin
    routes additionally need the admin key (`require_admin`)."""
    if path in OPEN_PATHS or not api_key:
        return []
    return [k for k in (api_key, admin_api_key) if k]


async def require_admin(request: HttpRequest) -> None:
    """Per-route dependency of every state-changing route. Async and free of sub-dependencies,
    so FastAPI runs it inline (no thread hop); only admin routes pay for it, never /generate."""
    key = request.app.state.engine.cfg.admin_api_key
    if key and not key_matches(request.headers.get("authorization"), [key]):
        raise UnauthorizedError(UNAUTHORIZED["error"]["message"])


ADMIN = Depends(require_admin)


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
    """Pure ASGI middleware applying the `--api-key` check and `check_size` before a route runs.

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
            refused = None
            keys = accepted_keys(scope["path"], api_key=self.api_key,
                                 admin_api_key=self.admin_api_key)
            authorization = headers.get(b"authorization")
            if keys and not key_matches(authorization and authorization.decode("latin-1"), keys):
                refused = JSONResponse(UNAUTHORIZED, status_code=401)
            length = headers.get(b"content-length")
            refused = refused or check_size(length and length.decode("latin-1"),
                                            limit_bytes=self.max_request_bytes)
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _resolve_under(path: str, roots: list[Path]) -> Path | None:
    resolved = Path(os.path.realpath(path))
    for root in roots:
        if resolved == root or root in resolved.parents:
            return resolved
    return None


def confine(path: str, roots: list[Path], *, what: str) -> Path:
    """Resolve `path` and require it under one of `roots` (symlinks resolved first)."""
    resolved = _resolve_under(path, roots)
    if resolved is None:
        allowed = ", ".join(str(r) for r in roots) or "(none)"
        raise BadInputError(f"{what} {path} is outside the allowed weight roots ({allowed}); "
                            "start the engine with --allowed-weight-root DIR to allow it")
    return resolved


def confine_local(path: str, local_root: Path | None) -> Path:
    """The directory `/pull_weights` may write into: `--local-checkpoint-dir` or one under it.

    Stricter than the weight roots on purpose: a pull replaces the directory's contents, so any
    other directory an engine can read (the run's published versions among them) is refused."""
    if local_root is None:
        raise BadInputError("/pull_weights needs the engine started with --local-checkpoint-dir "
                            "DIR, the only directory it may write into")
    root = Path(os.path.realpath(local_root))
    resolved = _resolve_under(path, [root])
    if resolved is None:
        raise BadInputError(f"local_checkpoint_dir {path} is outside the engine's "
                            f"--local-checkpoint-dir {root}; /pull_weights writes only there")
    return resolved
