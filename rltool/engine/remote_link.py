"""The front end's side of the two-process layout (docs/serve.md "Process layout"): the link the
routes use to reach the scheduler process (`RemoteLink`, the twin of rltool.engine.link.LocalLink),
over the channel of rltool.engine.ipc (the process itself is started by
rltool.engine.scheduler_child).

Everything here runs on the front end's event loop: a step message is read once and fans out to
the requests it names (their callbacks run on the loop thread). Streamed requests get their new
tokens here and their text decoded here, incrementally (`StreamedText`), never on the
scheduler; a finished request's response is built here from its final record. A failure while
handling one request's part of a message (its text, its response) ends only that request, with
500, as a failed step does in one process. When the channel breaks (the scheduler process
exits, a frame cannot be read), every request and call waiting on it ends with 503 ("the
scheduler process exited") and `on_exit` tells the server to stop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import time
from collections.abc import Callable
from typing import Any

from rltool.engine import ipc
from rltool.engine.detokenize import StreamedText
from rltool.engine.link import EngineInfo
from rltool.engine.request import Request
from rltool.errors import BadInputError, EngineError

log = logging.getLogger(__name__)
EXIT_POLL_S = 1.0  # how often the front end looks whether the scheduler process still runs


class RemoteLink:
    """Requests and named calls to the scheduler process. `submit` raises what the front end can
    tell at once (a duplicate request id, the process gone); the scheduler's refusals arrive
    later, through `on_refused`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 proc: subprocess.Popen, info: EngineInfo, weight_version: str):
        self.reader, self.writer, self.proc = reader, writer, proc
        self.tokenizer = info.tokenizer
        self.weight_version = weight_version
        # lora_path names are checked by the scheduler process at submit (it holds the adapters)
        self.lora_names = _CheckedAtSubmit() if info.lora_enabled else None
        self.pending: dict[str, tuple[Request, Callable[[Exception], None]]] = {}
        self.texts: dict[str, StreamedText] = {}  # rid -> its text so far (streamed requests)
        self.calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self.exited: str | None = None  # why the channel closed
        self.stopping = False
        self.on_exit: Callable[[], None] = lambda: None
        self._tasks: list[asyncio.Task] = []
        self._out: list[bytes] = []  # frames waiting for the end of this turn of the loop

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]

    @property
    def alive(self) -> bool:
        return self.exited is None and not self.stopping

    @property
    def failed(self) -> bool:
        """The scheduler process ended without being told to."""
        return self.exited is not None and not self.stopping

    def _send(self, msg: dict[str, Any]) -> None:
        if self.exited is not None:
            raise EngineError(self.exited)
        if self.stopping:
            raise EngineError("the engine is shutting down")
        # Frames of one turn of the event loop go out in one write, in order (a burst of
        # requests arriving together costs the scheduler process one wake-up).
        self._out.append(ipc.frame(msg))
        if len(self._out) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        data, self._out = b"".join(self._out), []
        if self.exited is None and data:
            self.writer.write(data)

    def submit(self, reqs: list[Request], *, on_refused: Callable[[Exception], None]) -> None:
        dup = next((r.rid for r in reqs if r.rid in self.pending), None)
        if dup is not None:
            raise BadInputError(f"duplicate request id {dup!r}")
        self._send({"t": "submit", "reqs": [ipc.encode_request(r, stream=r.on_token is not None)
                                             for r in reqs]})
        for r in reqs:
            self.pending[r.rid] = (r, on_refused)
            if r.on_token is not None:
                self.texts[r.rid] = StreamedText(self.tokenizer, r.params.skip_special_tokens)

    def abort(self, rids: list[str]) -> None:
        if self.alive:
            self._send({"t": "abort", "rids": rids})

    async def call(self, op: str, /, **kwargs: Any) -> Any:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._send({"t": "call", "id": call_id, "op": op, "kw": kwargs})
        self.calls[call_id] = future
        return await future

    def request_stop(self) -> None:
        """Ask the scheduler process to stop: it aborts what is in flight (503) and exits."""
        if self.alive:
            self._out.append(ipc.frame({"t": "stop"}))
            self._flush()
        self.stopping = True

    # ----- what the scheduler process sends ------------------------------------------------

    async def _read(self) -> None:
        try:
            while True:
                self._handle(await ipc.read_message(self.reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:  # a malformed message: the channel cannot be trusted any more
            log.exception("reading the scheduler channel failed")
        self._close(f"the scheduler process exited (code {self.proc.poll()})")

    async def _watch(self) -> None:
        # EOF on the channel tells of the exit, unless a descendant of the scheduler process
        # inherited the socket; the exit status says it in any case.
        while self.proc.poll() is None:
            await asyncio.sleep(EXIT_POLL_S)
        await asyncio.sleep(EXIT_POLL_S)  # let the reader take the last messages first
        self._close(f"the scheduler process exited (code {self.proc.returncode})")

    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "step":
            self._step(msg)
        elif kind == "reply":
            future = self.calls.pop(msg["id"], None)
            if future is not None and not future.done():
                if "err" in msg:
                    future.set_exception(ipc.error_from(msg["err"]))
                else:
                    future.set_result(msg["ok"])
        elif kind == "refused":
            callbacks = {}
            for rid in msg["rids"]:
                self.texts.pop(rid, None)
                _, on_refused = self.pending.pop(rid, (None, None))
                if on_refused is not None:
                    callbacks[id(on_refused)] = on_refused
            for on_refused in callbacks.values():
                on_refused(ipc.error_from(msg["err"]))
        else:
            raise ValueError(f"unknown message {kind!r} from the scheduler process")

    def _step(self, msg: dict[str, Any]) -> None:
        version = self.weight_version = msg["v"]
        tok = msg["tok"]
        if tok is not None:
            self._tokens(tok, version)
        for final in msg["fin"]:
            self.texts.pop(final["rid"], None)
            entry = self.pending.pop(final["rid"], None)
            if entry is not None:
                req = entry[0]
                try:
                    ipc.apply_final(req, final)
                    if req.on_finish is not None:
                        req.on_finish(req)
                except Exception as e:  # noqa: BLE001 - this request's failure, not the channel's
                    self._fail(req, e, running=False)

    def _tokens(self, tok: dict[str, Any], version: str) -> None:
        """The streamed rows' new tokens: counts, ids and logprobs packed row after row."""
        counts = ipc.unpack(tok["n"], "<i4")
        ids, logprobs = ipc.unpack(tok["ids"], "<i4"), ipc.unpack(tok["lp"], "<f8")
        extra = {row: (tops, ids_lps) for row, tops, ids_lps in tok["extra"]}
        spans = {row: row_spans for row, row_spans in tok["spans"]}
        start = 0
        for row, (rid, count) in enumerate(zip(tok["rids"], counts)):
            end = start + count
            entry = self.pending.get(rid)
            if entry is not None:
                try:
                    self._row(entry[0], ids[start:end], logprobs[start:end],
                              *extra.get(row, (None, None)), spans.get(row), version)
                except Exception as e:  # noqa: BLE001 - this request's failure, not the channel's
                    self._fail(entry[0], e, running=True)
            start = end

    def _row(self, req: Request, ids: list[int], logprobs: list[float], tops: Any, ids_lps: Any,
             row_spans: Any, version: str) -> None:
        """One streamed request's new tokens (several under multi-step decode), then one
        update for them (its stream's events are cumulative)."""
        for k, (token, logprob) in enumerate(zip(ids, logprobs)):
            sampled_with = version
            if row_spans is not None:  # a weight update fell among or after the tokens
                at = len(req.output_ids)
                sampled_with = next((v for v, i in reversed(row_spans) if i <= at), version)
            req.record_token(token, logprob, version=sampled_with,
                             top=None if tops is None else tops[k],
                             ids_lp=None if ids_lps is None else ids_lps[k])
        text = self.texts.get(req.rid)
        if text is not None:
            req.text = text.update(req.output_ids)
        if req.on_token is not None:
            req.on_token(req)

    def _fail(self, req: Request, error: Exception, *, running: bool) -> None:
        """Handling one request's message here failed (its response or text): that request
        ends with 500, as a failed step ends it in one process (a route answers its status or
        ends its stream with an error event), and the scheduler aborts it if `running`. The
        channel and every other request go on."""
        log.exception("handling request %s failed; it ends with 500", req.rid)
        self.texts.pop(req.rid, None)
        if self.pending.pop(req.rid, None) is not None and running:
            self.abort([req.rid])
        if req.on_finish is not None:
            req.on_finish(req.failed_copy(error))

    def _close(self, reason: str) -> None:
        if self.exited is not None:
            return
        self.exited = reason
        if not self.stopping:
            log.error("%s; answering 503 and shutting down", reason)
        pending, self.pending = self.pending, {}
        self.texts.clear()
        for req, _ in pending.values():
            req.finish_reason = {"type": "abort", "status_code": 503,
                                 "message": f"{reason}; the engine is shutting down"}
            req.t_finish = time.monotonic()
            if req.on_finish is not None:
                req.on_finish(req)
        calls, self.calls = self.calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineError(reason))
        self.on_exit()


class _CheckedAtSubmit:
    """The front end holds no adapters: the scheduler process checks lora_path names."""

    def check_name(self, name: str | None) -> None:
        return None
