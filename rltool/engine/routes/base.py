"""What every router of the builtin engine shares: the engine state with its generation plumbing,
body parsing and the error shapes.

Handlers run on the event loop and never touch the model: generation requests go to the
scheduler through the state's link with completion callbacks, control operations are named calls
of rltool.engine.ops.EngineOps (`EngineState.link.call`), run in this process or in the scheduler
process (rltool.engine.link).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from rltool.engine.api import GenerateInput
from rltool.engine.config import ServeConfig
from rltool.engine.expand import expand_generate
from rltool.engine.link import EngineInfo, LocalLink
from rltool.engine.ops import EngineOps
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request, build_response
from rltool.engine.scheduler import QueueFullError
from rltool.engine.security import PayloadTooLargeError
from rltool.errors import BadInputError, EngineError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


@dataclass
class EngineState:
    """The routes' view of the engine: its config, facts (`info`) and `link`. Built from a runner
    and scheduler of this process (one-process layout) or from a link to the scheduler process
    and the facts it sent (rltool.engine.remote_link)."""

    cfg: ServeConfig
    runner: PagedRunner | None = None
    scheduler: PagedScheduler | None = None
    started: float = field(default_factory=time.monotonic)  # time.monotonic() at start
    started_wall_s: float = field(default_factory=time.time)
    link: Any = None  # LocalLink or RemoteLink
    info: EngineInfo | None = None

    def __post_init__(self) -> None:
        if self.link is None:
            self.link = LocalLink(EngineOps(runner=self.runner, scheduler=self.scheduler,
                                            max_running=self.cfg.max_running_requests,
                                            allowed_sync_hosts=self.cfg.allowed_sync_hosts))
        if self.info is None:
            self.info = EngineInfo.of_runner(self.runner)

    @property
    def served_model_name(self) -> str:
        return self.cfg.served_model_name or str(self.cfg.model)

    @property
    def weight_version(self) -> str:
        return self.link.weight_version

    async def model_info(self) -> dict[str, Any]:
        """SGLang's /get_model_info body (model and tokenizer paths, weight version, ...)."""
        return {**await self.link.call("model_info"),
                "served_model_name": self.served_model_name}

    def expand(self, body: GenerateInput) -> tuple[list[Request], bool]:
        info = self.info
        try:
            return expand_generate(body, tokenizer=info.tokenizer,
                                   context_length=info.context_length,
                                   vocab_size=info.vocab_size,
                                   max_requests=(self.cfg.max_queued_requests
                                                 + self.cfg.max_running_requests),
                                   deterministic=self.cfg.deterministic,
                                   moe=info.moe, lora=self.link.lora_names)
        except ValidationError as e:  # sampling_params
            raise BadInputError(describe_errors(e.errors())) from e

    def respond(self, req: Request) -> dict[str, Any]:
        return build_response(req, tokenizer=self.info.tokenizer,
                              weight_version=self.link.weight_version)

    def _abort(self, reqs: list[Request]) -> None:
        self.link.abort([r.rid for r in reqs])

    async def run(self, reqs: list[Request], *, client: HttpRequest | None = None
                  ) -> list[dict[str, Any]]:
        """Submit `reqs` and await their final responses (in order). With `client`, the HTTP
        request whose body has been read, they are aborted if its client goes away first (they
        finish as aborted, so the answer still comes back, to nobody). Raises QueueFullError /
        BadInputError / EngineError if the scheduler refuses them."""
        loop, here = asyncio.get_running_loop(), threading.get_ident()
        done = loop.create_future()
        responses: list[Any] = [None] * len(reqs)
        left = [len(reqs)]
        lock = threading.Lock()

        def finished(i: int, req: Request) -> None:
            # One wake-up of the event loop for the whole batch, when its last request ends
            # (one per request was a self-pipe write each, ~128 per rollout step).
            responses[i] = self.respond(req)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                _on_loop(loop, here, _resolve, done, responses)

        for i, req in enumerate(reqs):
            req.on_finish = functools.partial(finished, i)
        self.link.submit(reqs, on_refused=lambda e: _resolve(done, e))
        watch = None if client is None else asyncio.ensure_future(self._abort_if_gone(client, reqs))
        try:
            result = await done
        except asyncio.CancelledError:  # client went away: free the engine
            self._abort(reqs)
            raise
        finally:
            if watch is not None:
                watch.cancel()
        if isinstance(result, Exception):
            raise result
        return list(result)

    async def _abort_if_gone(self, client: HttpRequest, reqs: list[Request]) -> None:
        # uvicorn does not cancel a handler whose client disconnected (a streamed response
        # notices by itself): past the body, the next ASGI message is the disconnect.
        while (await client.receive())["type"] != "http.disconnect":
            pass
        self._abort(reqs)

    async def updates(self, reqs: list[Request]
                      ) -> AsyncIterator[tuple[int, bool, dict[str, Any]]]:
        """Submit `reqs`; yield (index, finished, cumulative response) as their tokens come:
        each time this generator runs, one update for every request with news, holding all its
        tokens since its last. Events are cumulative, so a stream that falls behind the engine
        sends fewer, fuller ones and loses nothing (SGLang's streams coalesce the same way).
        Raises QueueFullError / BadInputError / EngineError if the scheduler refuses them."""
        loop, here = asyncio.get_running_loop(), threading.get_ident()
        news: dict[int, tuple[bool, Request | dict[str, Any]]] = {}
        refused: list[Exception] = []
        woken = asyncio.Event()

        def note(i: int, final: bool, got: Request | dict[str, Any]) -> None:
            news[i] = (final, got)
            woken.set()

        def changed(i: int, final: bool, req: Request) -> None:
            if threading.get_ident() == here:  # two processes: `req` changes on this loop only
                note(i, final, req)
            else:  # one process: the scheduler thread changes it, so its response is built there
                loop.call_soon_threadsafe(note, i, final, self.respond(req))

        def refuse(e: Exception) -> None:
            refused.append(e)
            woken.set()

        for i, req in enumerate(reqs):
            req.on_token = functools.partial(changed, i, False)
            req.on_finish = functools.partial(changed, i, True)
        self.link.submit(reqs, on_refused=lambda e: _on_loop(loop, here, refuse, e))
        remaining = set(range(len(reqs)))
        try:
            while remaining:
                await woken.wait()
                woken.clear()
                if refused:
                    raise refused[0]
                batch = sorted(news.items())
                news.clear()
                for i, (final, got) in batch:
                    if i in remaining:
                        final, event = self._event(reqs[i], got, final)
                        if final:
                            remaining.discard(i)
                        yield i, final, event
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            self._abort(reqs)
            raise

    def _event(self, req: Request, got: Request | dict[str, Any], final: bool
               ) -> tuple[bool, dict[str, Any]]:
        """(finished, response) of an update: built in one process already; in two, built
        here, where a failure ends only this request (500; the scheduler aborts it), as a failed
        step would."""
        if isinstance(got, dict):
            return final, got
        try:
            return final, self.respond(got)
        except Exception as e:  # this request's failure, not the stream's
            log.exception("building the response of request %s failed; it ends with 500",
                          req.rid)
            if not final:
                self._abort([req])
            return True, self.respond(req.failed_copy(e))


def openai_error(message: str, status_code: int = 400) -> JSONResponse:
    """SGLang's OpenAI-style error object: a body that fails validation (400), and every error
    of the OpenAI routes."""
    kind = {400: "Bad Request", 429: "Too Many Requests"}.get(status_code, "Error")
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": None,
                         "code": status_code}, status_code=status_code)


def runtime_error(message: str, status_code: int = 400) -> JSONResponse:
    """A runtime refusal: `{"error": {"message": ...}}`."""
    return JSONResponse({"error": {"message": message}}, status_code=status_code)


def describe_errors(errors: Any) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts)


async def read_body(request: HttpRequest) -> bytes:
    """The request body, bounded by --max-request-bytes even without a Content-Length header."""
    limit = request.app.state.engine.cfg.max_request_bytes
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def parse_body(request: HttpRequest, model: type[M], *, required: bool = True) -> M:
    """Read a JSON object body (`read_body`) and validate it as the OpenAI routes do (pydantic's
    JSON parser: UTF-8, no lone surrogate, nesting bounded); failures raise
    RequestValidationError (400). A body not declared `application/json` never gets here: the
    `Guard` middleware answers it 415, since a web page can send any other type unasked."""
    raw = await read_body(request)
    if not raw.strip():
        if required:
            raise RequestValidationError([{"msg": "a JSON body is required ({} works)"}])
        raw = b"{}"
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise RequestValidationError([{"msg": f"body is not valid JSON ({first['msg']}); "
                                                  "send a UTF-8 JSON object"}]) from e
        if first["type"] == "model_type" and not first["loc"]:
            raise RequestValidationError([{"msg": "body must be a JSON object"}]) from e
        raise RequestValidationError(e.errors()) from e


def failure(*outs: dict[str, Any]) -> tuple[str, int] | None:
    """(message, HTTP status) of the first of `outs` (final results) that the engine failed,
    aborting it with a status; None when none was."""
    for out in outs:
        reason = out["meta_info"]["finish_reason"] or {}
        if reason.get("type") == "abort" and reason.get("status_code"):
            return reason["message"], int(reason["status_code"])
    return None


def failure_event(message: str, status_code: int) -> dict[str, Any]:
    """The stream's error event in place of the last update of a request the engine failed (a
    4xx, such as a stop_regex over its time budget, is the request's fault: not retryable)."""
    server = status_code >= 500
    return {"error": {"message": message, "code": status_code, "retryable": server,
                      "type": "server_error" if server else "invalid_request_error"}}


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def sse_stream(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """A generation's server-sent events (/generate's and the OpenAI routes' streams): each
    event, then `data: [DONE]`. A refusal raised on the way ends the events with an error event
    (the status line has been sent already): a full queue is code 429 and retryable, anything
    else (a duplicate request id, the engine shutting down) code 400."""
    try:
        async for event in events:
            yield _sse(event)
    except (BadInputError, EngineError) as e:
        code = 429 if isinstance(e, QueueFullError) else 400
        yield _sse({"error": {"message": str(e), "type": "invalid_request_error", "code": code,
                              "retryable": code == 429}})
    yield b"data: [DONE]\n\n"


def _on_loop(loop: asyncio.AbstractEventLoop, loop_thread: int, fn: Callable[..., Any],
             *args: Any) -> None:
    """Call `fn` on `loop`, whose thread is `loop_thread`: at once from that thread (the
    two-process link calls back there), else scheduled from the scheduler thread (a wake-up of
    the loop each)."""
    if threading.get_ident() == loop_thread:
        fn(*args)
    else:
        loop.call_soon_threadsafe(fn, *args)


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
