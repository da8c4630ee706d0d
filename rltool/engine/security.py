"""Auth, request size limits and path confinement for the builtin engine.

- `--api-key`: every route but the open ones (`api.OPEN_PATHS`: `/health*`, `/ready`)
  needs `Authorization: Bearer <key>`; checked by `Guard`, a plain ASGI middleware.
- `--admin-api-key`: routes that change the engine's state are marked where they are defined with
  the `ADMIN` dependency, which then asks for this key (without it they fall back to `--api-key`).
  The admin key also opens the ordinary routes, so one client holding it can drive the engine.
- Bodies larger than `--max-request-bytes` get 413 before they are read.
- Web pages are kept out (`Guard`): a `Host` that is not an address of the engine gets 421 (DNS
  rebinding needs a name the attacker controls), a cross-origin browser request to a route that
  changes state gets 403, and a body that is not `application/json` gets 415 (a page can send
  `text/plain`, a form or a typeless blob without asking the engine first; JSON it cannot).
- Weight paths (`/update_weights_from_disk`'s model_path, `/pull_weights`'s source_dir,
  `/load_lora_adapter`'s lora_path) must lie under an allowed root (`ServeConfig.weight_roots`),
  and so must every symbolic link inside them; `/pull_weights` writes only into
  `--local-checkpoint-dir` or a directory under it (`confine_local`). Symlinks are resolved first.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import Depends, Request as HttpRequest
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

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


def check_size(length: int | None, *, limit_bytes: int) -> str | None:
    """Why a body of `length` bytes (None: not declared) is refused, or None."""
    if length is not None and length > limit_bytes:
        return f"request body of {length} bytes exceeds the limit of {limit_bytes} bytes"
    return None


def admin_paths(routes: Iterable[Any]) -> frozenset[str]:
    """Paths of the routes that carry the `ADMIN` guard: the ones that change state, whatever the
    method (/flush_cache and the memory routes also answer GET, as in SGLang)."""
    return frozenset(r.path for r in routes if isinstance(r, APIRoute)
                     and any(d.call is require_admin for d in r.dependant.dependencies))


# Methods that change nothing on a route without the ADMIN guard: a cross-origin page may send
# them (a read is no use to it: the browser keeps the answer from it without CORS headers).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
CROSS_SITE = frozenset({"cross-site", "same-site"})  # Sec-Fetch-Site of another origin's page
JSON_TYPE = "application/json"
MAX_ACCEPTED_HOSTS = 64
_HEADERS = frozenset({b"authorization", b"content-length", b"content-type", b"host", b"origin",
                      b"sec-fetch-site", b"transfer-encoding"})


def host_name(authority: str) -> str:
    """The name in a `Host` value or an `--allowed-hosts` entry: lower case, without the port, the
    IPv6 brackets or a trailing dot."""
    name = authority.strip().lower()
    if name.startswith("["):
        name = name[1:name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    return name.rstrip(".")


class HostCheck:
    """Which `Host` values reach the engine: its bound address, a loopback name or address (any
    port), the address the connection arrived at, the names of `--allowed-hosts` (`*`: any), and
    with a wildcard bind (0.0.0.0, ::) any IP address. A DNS name is accepted only when named,
    because DNS rebinding (a page's own name re-pointed at this machine) needs a name."""

    def __init__(self, *, bind_host: str, allowed_hosts: Iterable[str]):
        allowed = list(allowed_hosts)
        self.any = "*" in allowed
        self.wildcard = host_name(bind_host) in WILDCARD_BINDS
        self.names = frozenset({host_name(h) for h in allowed} | {host_name(bind_host),
                                                                   "localhost"})

    def allows(self, host: str | None, server: Any) -> bool:
        # No Host at all is HTTP/1.0 from a program; every browser sends one.
        if self.any or host is None:
            return True
        name = host_name(host)
        if name in self.names or (server and name == str(server[0]).lower()):
            return True
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            return False
        return self.wildcard or ip.is_loopback


def cross_origin(origin: str | None, fetch_site: str | None, host: str | None) -> str | None:
    """What marks a request as made by a page of another origin, or None. `Origin` must name the
    engine's own `Host` (browsers add it to every POST and every cross-origin fetch);
    `Sec-Fetch-Site` also covers what carries no Origin (an <img> or a link's GET)."""
    if origin is not None:
        _, sep, authority = origin.partition("://")
        if not sep or host is None or authority.lower() != host.lower():
            return f"Origin {origin}"
    if fetch_site is not None and fetch_site.lower() in CROSS_SITE:
        return f"Sec-Fetch-Site {fetch_site}"
    return None


def body_type_error(content_type: str | None, *, has_body: bool) -> str | None:
    """Why a request's Content-Type is refused, or None: bodies are JSON and say so."""
    if content_type is None:
        return f"a request body needs Content-Type: {JSON_TYPE}" if has_body else None
    if content_type == JSON_TYPE or content_type.partition(";")[0].strip().lower() == JSON_TYPE:
        return None
    return (f"Content-Type {content_type!r} is not accepted: request bodies are JSON; send "
            f"Content-Type: {JSON_TYPE}")


def _refusal(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


class Guard:
    """Pure ASGI middleware run before every route: the `Host` check (421), the cross-origin check
    on routes that change state (403), the `--api-key` check (401), the Content-Type check (415)
    and `check_size` (413).

    Starlette's `@app.middleware("http")` (BaseHTTPMiddleware) re-wraps every request and response
    body in extra tasks and streams; on this engine's hot path that cost more per request than the
    route itself, so the guard is a plain ASGI callable, and reads the headers in one pass.
    """

    def __init__(self, app: Any, *, api_key: str | None, admin_api_key: str | None,
                 max_request_bytes: int, hosts: HostCheck, admin_paths: frozenset[str]):
        self.app = app
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.max_request_bytes = max_request_bytes
        self.hosts, self.admin_paths = hosts, admin_paths
        # (Host, local address) pairs already accepted: a client sends the same Host on every
        # request, so after the first one the check is one set lookup. Bounded, since the values
        # come from clients.
        self.accepted_hosts: set[tuple[str | None, Any]] = set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = self.refusal(scope)
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: dict[str, Any]) -> JSONResponse | None:
        headers = {k.lower(): v.decode("latin-1") for k, v in scope["headers"]
                   if k.lower() in _HEADERS}
        host = headers.get(b"host")
        server = scope.get("server")
        seen = (host, server and server[0])
        if seen not in self.accepted_hosts:
            if not self.hosts.allows(host, server):
                return _refusal(421, f"Host {host!r} is not an address of this engine; reach it "
                                     "by its address or localhost, or start it with "
                                     f"--allowed-hosts {host_name(host or '')}")
            if len(self.accepted_hosts) < MAX_ACCEPTED_HOSTS:
                self.accepted_hosts.add(seen)
        path = scope["path"]
        if scope["method"] not in SAFE_METHODS or path in self.admin_paths:
            why = cross_origin(headers.get(b"origin"), headers.get(b"sec-fetch-site"), host)
            if why is not None:
                return _refusal(403, f"cross-origin request refused ({why}): the engine answers "
                                     "no web page of another origin; call it from a program")
        keys = accepted_keys(path, api_key=self.api_key, admin_api_key=self.admin_api_key)
        if keys and not key_matches(headers.get(b"authorization"), keys):
            return JSONResponse(UNAUTHORIZED, status_code=401)
        declared = headers.get(b"content-length")
        try:
            length = None if declared is None else int(declared)
        except ValueError:
            return _refusal(400, "invalid Content-Length")
        has_body = bool(length) or b"transfer-encoding" in headers
        why = body_type_error(headers.get(b"content-type"), has_body=has_body)
        if why is not None:
            return _refusal(415, why)
        why = check_size(length, limit_bytes=self.max_request_bytes)
        return None if why is None else _refusal(413, why)


def _resolve_under(path: str, roots: list[Path]) -> Path | None:
    resolved = Path(os.path.realpath(path))
    for root in roots:
        if resolved == root or root in resolved.parents:
            return resolved
    return None


def confine(path: str, roots: list[Path], *, what: str) -> Path:
    """Resolve `path` and require it, and whatever a link inside it leads to, under one of
    `roots` (symlinks resolved first)."""
    resolved = _resolve_under(path, roots)
    if resolved is None:
        allowed = ", ".join(str(r) for r in roots) or "(none)"
        raise BadInputError(f"{what} {path} is outside the allowed weight roots ({allowed}); "
                            "start the engine with --allowed-weight-root DIR to allow it")
    escape = _link_outside(resolved, roots)
    if escape is not None:
        raise BadInputError(f"{what} {path} holds {escape}, a link to a path outside the allowed "
                            "weight roots; copy its target in, or allow the target's directory "
                            "with --allowed-weight-root DIR")
    return resolved


def _link_outside(directory: Path, roots: list[Path]) -> str | None:
    """The first symbolic link found under `directory` (links followed) that leads outside
    `roots`; None when every one stays inside."""
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a link cycle, or a directory reached twice
            dirnames.clear()
            continue
        seen.add(real)
        for name in dirnames + filenames:
            entry = os.path.join(dirpath, name)
            if os.path.islink(entry) and _resolve_under(entry, roots) is None:
                return entry
    return None


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
