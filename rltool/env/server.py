"""`rltool env serve`: one environment over HTTP, an episode per client session.

Routes (JSON bodies; every route but `/health` needs `Authorization: Bearer KEY` with
`--api-key`; the engine's `Guard` middleware checks the key, the Host, cross-origin requests,
the Content-Type and the body size):

    GET    /health                      {"status": "ok"}
    GET    /info                        {env, description, stop, open_episodes, max_episodes,
                                         step_timeout_s}
    POST   /episodes                    {seed, task} -> {episode_id, messages}   (reset)
    POST   /episodes/{id}/step          {action} -> {observation, reward, done, info}
    POST   /episodes/{id}/verify        {} -> {reward: float | null}
    DELETE /episodes/{id}               -> {closed: true}

At most `--max-episodes` are open (429 beyond); at most `--workers` environment calls run at
once, each in a daemon thread under `--step-timeout-s` (504: the episode is closed; the thread
cannot be stopped and is abandoned, rltool.env.threads); an environment that raises or answers
something malformed answers 500 and closes its episode; an unknown or closed episode 404; a
malformed body 400. Idle episodes close after `--episode-ttl-s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rltool.engine.security import Guard, HostCheck
from rltool.env.base import (Environment, EnvError, EnvTimeoutError, StepResult,
                             check_messages, load_env_class)
from rltool.env.config import EnvServeConfig
from rltool.env.threads import CallLimiter, call_in_thread
from rltool.errors import RltoolError

log = logging.getLogger(__name__)
HEALTH = "/health"  # rltool.engine.api.HEALTH: the Guard leaves it open


@dataclass
class _Episode:
    env: Environment
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EnvService:
    """The episodes of one server and the calls into them (no HTTP here)."""

    def __init__(self, cfg: EnvServeConfig):
        self.cfg = cfg
        self.cls = load_env_class(cfg.env)
        self.episodes: dict[str, _Episode] = {}
        self.limiter = CallLimiter(cfg.workers)
        self.counts = {"episodes": 0, "steps": 0, "timeouts": 0, "errors": 0}

    def info(self) -> dict[str, Any]:
        return {"env": self.cfg.env, "name": getattr(self.cls, "name", "") or self.cfg.env,
                "description": getattr(self.cls, "description", ""),
                "stop": list(getattr(self.cls, "stop", []) or []),
                "open_episodes": len(self.episodes), "max_episodes": self.cfg.max_episodes,
                "step_timeout_s": self.cfg.step_timeout_s, "counts": dict(self.counts)}

    async def _run(self, fn: Any, *args: Any, what: str, **kwargs: Any) -> Any:
        try:
            return await call_in_thread(fn, *args, timeout_s=self.cfg.step_timeout_s, what=what,
                                        limiter=self.limiter, **kwargs)
        except EnvTimeoutError:
            self.counts["timeouts"] += 1
            raise HttpError(504, f"{what} took more than {self.cfg.step_timeout_s:g}s; "
                                 "the episode is closed") from None
        except HttpError:
            raise
        except Exception as e:
            self.counts["errors"] += 1
            log.warning("environment %s failed in %s: %s: %s", self.cfg.env, what,
                        type(e).__name__, e)
            raise HttpError(500, f"{what} failed: {type(e).__name__}: {e}; the episode is "
                                 "closed") from e

    def expire(self) -> None:
        cutoff = time.monotonic() - self.cfg.episode_ttl_s
        for eid in [e for e, ep in self.episodes.items() if ep.last_used < cutoff and not ep.busy]:
            self._close(eid)

    def _close(self, eid: str) -> None:
        ep = self.episodes.pop(eid, None)
        if ep is not None:  # in a thread of its own: a close may block
            threading.Thread(target=_quiet_close, args=(ep.env,), daemon=True).start()

    async def open(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise HttpError(400, "body must be an object {seed, task}")
        seed, task = body.get("seed", 0), body.get("task", {})
        if isinstance(seed, bool) or not isinstance(seed, int) or not isinstance(task, dict):
            raise HttpError(400, "seed must be an integer and task an object")
        self.expire()
        if len(self.episodes) >= self.cfg.max_episodes:
            raise HttpError(429, f"{len(self.episodes)} episodes are open, the most "
                                 f"--max-episodes allows; close one (DELETE) or retry later")
        env = self.cls()
        eid = secrets.token_hex(12)
        self.episodes[eid] = _Episode(env=env, busy=True)
        try:
            messages = await self._run(env.reset, seed=seed, task=task, what="reset")
            messages = check_messages(messages, where="reset")
        except EnvError as e:
            self._close(eid)
            raise HttpError(500, str(e)) from e
        except HttpError:
            self._close(eid)
            raise
        self.episodes[eid].busy = False
        self.counts["episodes"] += 1
        return {"episode_id": eid, "messages": messages}

    def _get(self, eid: str) -> _Episode:
        ep = self.episodes.get(eid)
        if ep is None:
            raise HttpError(404, f"no open episode {eid}; open one with POST /episodes")
        if ep.busy:
            raise HttpError(409, f"episode {eid} is still answering a call; send one at a time")
        return ep

    async def step(self, eid: str, body: Any) -> dict[str, Any]:
        action = body.get("action") if isinstance(body, dict) else None
        if not (isinstance(action, dict) and isinstance(action.get("content"), str)):
            raise HttpError(400, "body must be {action: {role, content: str, finish}}")
        ep = self._get(eid)
        ep.busy = True
        try:
            result = await self._run(ep.env.step, action, what="step")
            out = StepResult.from_json(result, where="step").to_json()
        except EnvError as e:  # a malformed answer
            self._close(eid)
            raise HttpError(500, f"{e}; the episode is closed") from e
        except HttpError:
            self._close(eid)
            raise
        ep.busy, ep.last_used = False, time.monotonic()
        self.counts["steps"] += 1
        return out

    async def verify(self, eid: str) -> dict[str, Any]:
        ep = self._get(eid)
        ep.busy = True
        try:
            reward = await self._run(ep.env.verify, what="verify")
        except HttpError:
            self._close(eid)
            raise
        ep.busy, ep.last_used = False, time.monotonic()
        return {"reward": None if reward is None else float(reward)}

    def close(self, eid: str) -> dict[str, Any]:
        if eid not in self.episodes:
            raise HttpError(404, f"no open episode {eid}")
        self._close(eid)
        return {"closed": True}

    def shutdown(self) -> None:
        for eid in list(self.episodes):
            self._close(eid)


def _quiet_close(env: Environment) -> None:
    try:
        env.close()
    except Exception as e:  # noqa: BLE001 - a failing close must not take the server down
        log.warning("environment close failed: %s: %s", type(e).__name__, e)


def build_app(service: EnvService) -> Any:
    cfg = service.cfg
    app = FastAPI(title="rltool environment server", docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.exception_handler(HttpError)
    async def _on_http_error(request: Request, exc: HttpError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=exc.status)

    async def json_body(request: Request) -> Any:
        raw = await request.body()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError as e:
            raise HttpError(400, f"body is not valid JSON ({e})") from e

    @app.get(HEALTH)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return service.info()

    @app.post("/episodes")
    async def open_episode(request: Request) -> dict[str, Any]:
        return await service.open(await json_body(request))

    @app.post("/episodes/{eid}/step")
    async def step(eid: str, request: Request) -> dict[str, Any]:
        return await service.step(eid, await json_body(request))

    @app.post("/episodes/{eid}/verify")
    async def verify(eid: str) -> dict[str, Any]:
        return await service.verify(eid)

    @app.delete("/episodes/{eid}")
    async def close(eid: str) -> dict[str, Any]:
        return service.close(eid)

    app.add_middleware(Guard, api_key=cfg.api_key, admin_api_key=None,
                       max_request_bytes=cfg.max_request_bytes,
                       hosts=HostCheck(bind_host=cfg.host, allowed_hosts=cfg.allowed_hosts),
                       admin_paths=frozenset())
    return app


def _note_signal(signum: int, frame: object) -> None:
    log.info("received signal %d; shutting down", signum)


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RltoolError(f"cannot bind {host}:{port}: {e}; pick another --port (0 = any free)") \
            from e
    sock.listen(512)
    return sock


def serve(cfg: EnvServeConfig) -> None:
    """Serve until SIGTERM/SIGINT (blocking). BadInputError before binding for an unknown env."""
    import uvicorn

    from rltool.engine.api import url_of
    from rltool.supervisor import announce_ready, withdraw_ready

    service = EnvService(cfg)  # resolves --env first: a bad name binds nothing
    sock = bind(cfg.host, cfg.port)
    url = url_of(cfg.host, sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(build_app(service), log_level=cfg.log_level,
                                           lifespan="off", access_log=False,
                                           timeout_graceful_shutdown=1))

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if not task.done():
            log.info("environment %s served at %s (pid %d)", cfg.env, url, os.getpid())
            announce_ready(cfg.ready_file, url=url, pid=os.getpid())
        await task

    # uvicorn re-raises the SIGTERM/SIGINT it caught once it has shut down; with the default
    # handler that would end the process before the cleanup below (the ready file would stay).
    previous = {sig: signal.signal(sig, _note_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        asyncio.run(main())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        service.shutdown()
        with contextlib.suppress(OSError):
            sock.close()
        withdraw_ready(cfg.ready_file)

