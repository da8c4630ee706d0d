"""The scheduler process of the two-process layout (docs/serve.md "Process layout"): the model,
KV cache and decode loop, apart from the HTTP front end (rltool.engine.server), reached over
the inherited socket of rltool.engine.ipc.

Threads: the main thread reads the channel (submits and aborts go straight to the scheduler, a
named call runs on the operations' event loop); the "rltool-ops" thread runs that loop
(rltool.engine.ops.EngineOps, as the front end's loop runs them in one process); the scheduler
thread runs the model and, after each iteration (`PagedScheduler.on_iteration`), sends ONE step
message: the tokens new since the last message of every streamed request and the final record of
every request that finished. Requests that are not streamed send nothing until they finish. An
operation that runs on the scheduler thread answers after that message (`StepOrderedOps`).

The process ends when the front end says stop or closes its end (it exited): requests in flight
are aborted (503), their final records sent while the channel is open. A scheduler thread that
dies unasked, or a step's results that cannot be sent, end it at once with EXIT_RUNTIME (the
front end then answers 503 and stops). SIGINT is ignored (a
terminal's Ctrl-C reaches the front end, which stops this process in order).

Run as `python -m rltool.engine.scheduler_process FD` by the front end only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from rltool.engine import ipc
from rltool.engine.config import ServeConfig
from rltool.engine.link import EngineInfo
from rltool.engine.ops import EngineOps
from rltool.engine.request import Request
from rltool.errors import EXIT_RUNTIME, BadInputError, EngineError, RltoolError
from rltool.supervisor import exit_now

log = logging.getLogger(__name__)
THREAD_POLL_S = 1.0  # how often the process looks whether its scheduler thread still runs


class Columns:
    """The new tokens of a step's streamed rows, column-wise: row ids, per-row counts, and all
    ids and logprobs row after row (packed); top logprobs only for the rows that asked; the
    weight-version spans only of the rows whose new tokens are not all of `version` (a weight
    update fell among them, or came after them)."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.rids: list[str] = []
        self.counts: list[int] = []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.extra: list[list[Any]] = []  # [row, top logprobs, token_ids logprobs]
        self.spans: list[list[Any]] = []  # [row, the request's spans]

    def add(self, req: Request, start: int, end: int) -> None:
        """Output tokens [start, end) of `req`, if any."""
        if end <= start:
            return
        if req.top_logprobs_num or req.token_ids_logprob:
            self.extra.append([len(self.rids),
                               req.output_top_logprobs[start:end] if req.top_logprobs_num
                               else None,
                               req.output_token_ids_logprobs[start:end] if req.token_ids_logprob
                               else None])
        spans = req.spans
        if spans and (spans[-1][1] > start or spans[-1][0] != self.version):
            self.spans.append([len(self.rids), spans])
        self.rids.append(req.rid)
        self.counts.append(end - start)
        self.ids += req.output_ids[start:end]
        self.logprobs += req.output_logprobs[start:end]

    def message(self) -> dict[str, Any] | None:
        if not self.rids:
            return None
        return {"rids": self.rids, "n": ipc.pack(self.counts, "<i4"),
                "ids": ipc.pack(self.ids, "<i4"), "lp": ipc.pack(self.logprobs, "<f8"),
                "extra": self.extra, "spans": self.spans}


class Outbox:
    """What the scheduler thread sends after an iteration. `stream` and `unstream` are called
    from the channel's reader thread; everything else runs on the scheduler thread."""

    def __init__(self, channel: ipc.Channel, runner: Any):
        self.channel = channel
        self.runner = runner
        self.finals: list[dict[str, Any]] = []
        self.streams: dict[str, tuple[Request, list[int]]] = {}  # rid -> (request, [sent])
        # Streamed requests that finished: (request, tokens sent, tokens before the last).
        self.tails: list[tuple[Request, int, int]] = []
        self._arrived: list[Request] = []
        self._refused: list[Request] = []  # refused after a flush may have taken them in
        self._streamed: set[str] = set()
        self._lock = threading.Lock()
        self.closed = False
        # (future, result, error) of operations that ran this iteration, resolved after its
        # step message: a call's reply never overtakes the final records it made (an abort's).
        self.answers: list[tuple[concurrent.futures.Future, Any, Exception | None]] = []

    def stream(self, req: Request) -> None:
        with self._lock:
            self._arrived.append(req)
            self._streamed.add(req.rid)

    def unstream(self, reqs: list[Request]) -> None:
        with self._lock:
            self._arrived = [r for r in self._arrived if r not in reqs]
            self._streamed.difference_update(r.rid for r in reqs)
            self._refused += reqs

    def finished(self, req: Request) -> None:
        entry = self.streams.pop(req.rid, None)
        with self._lock:
            streamed = req.rid in self._streamed
            self._streamed.discard(req.rid)
        if streamed:  # every token but the one that ended it gets an update, as in one process
            self.tails.append((req, entry[1][0] if entry else 0, len(req.output_ids) - 1))
        self.finals.append(ipc.encode_final(req))

    def flush(self) -> None:
        with self._lock:
            arrived, self._arrived = self._arrived, []
            refused, self._refused = self._refused, []
        for req in refused:
            if self.streams.get(req.rid, (None,))[0] is req:
                del self.streams[req.rid]
        for req in arrived:
            if not req.finished:
                self.streams[req.rid] = (req, [0])
        version = self.runner.weight_version
        columns = Columns(version)
        for req, start, end in self.tails:
            columns.add(req, start, end)
        for req, sent in self.streams.values():
            n = len(req.output_ids)
            columns.add(req, sent[0], n)
            sent[0] = n
        tokens, finals = columns.message(), self.finals
        self.tails, self.finals = [], []
        if (tokens is not None or finals) and not self.closed:
            try:
                self.channel.send({"t": "step", "v": version, "tok": tokens,
                                   "fin": finals})
            except OSError:  # the front end is gone; the reader thread ends the process
                self.closed = True
        answers, self.answers = self.answers, []
        for future, result, error in answers:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)


class StepOrderedOps(EngineOps):
    """The operations as the scheduler process runs them: what runs on the scheduler thread
    (a call or a weight update) answers once the iteration that ran it has sent its step
    message, so the front end has ended the requests an abort (or an update's abort_all)
    finished before the reply comes (and an aborted id is free again when the client hears of
    the abort, as in one process). One the scheduler never runs (it stopped) fails at once."""

    def __init__(self, *, outbox: Outbox, **kwargs: Any):
        super().__init__(**kwargs)
        self.outbox = outbox

    async def on_thread(self, fn: Callable[[], Any]) -> Any:
        return await self.after_step(fn, self.sched.call)

    async def on_update(self, apply: Callable[[], Any], *, abort_all: bool) -> Any:
        return await self.after_step(
            apply, lambda run: self.sched.update_weights(run, abort_all=abort_all))

    async def after_step(self, fn: Callable[[], Any],
                         queue: Callable[[Callable[[], None]], concurrent.futures.Future]) -> Any:
        """Queue `fn` with `queue` and await its result, handed over after the step message."""
        answered: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                result, error = fn(), None
            except Exception as e:  # noqa: BLE001 - handed to the caller through the future
                result, error = None, e
            self.outbox.answers.append((answered, result, error))

        def never_ran(queued: concurrent.futures.Future) -> None:
            if queued.exception() is not None:  # refused or dropped by the scheduler
                answered.set_exception(queued.exception())

        queue(run).add_done_callback(never_ran)
        return await asyncio.wrap_future(answered)


class SchedulerProcess:
    """The engine behind one channel."""

    def __init__(self, cfg: ServeConfig, channel: ipc.Channel, runner: Any, scheduler: Any):
        self.channel = channel
        self.runner = runner
        self.sched = scheduler
        self.outbox = Outbox(channel, runner)
        self.ops = StepOrderedOps(outbox=self.outbox, runner=runner, scheduler=scheduler,
                                  max_running=cfg.max_running_requests,
                                  allowed_sync_hosts=cfg.allowed_sync_hosts)
        scheduler.on_iteration = self.flush
        self.loop = asyncio.new_event_loop()
        self.stopping = threading.Event()

    def flush(self) -> None:
        """The outbox's flush; a failure ends the process (the front end then answers 503 and
        exits) rather than leaving the scheduler thread dead and every request waiting."""
        try:
            self.outbox.flush()
        except Exception:
            log.exception("sending a step's results failed; the scheduler process exits")
            os._exit(EXIT_RUNTIME)

    def watch_scheduler(self) -> None:
        """End the process (EXIT_RUNTIME) once the scheduler thread has died unasked (an error
        outside a step's handling): the front end then answers 503 and stops, as one process
        answers 503, instead of a server whose requests all wait."""
        while not self.stopping.wait(THREAD_POLL_S):
            if not self.sched.alive and not self.stopping.is_set():
                log.error("the scheduler thread died; the scheduler process exits")
                os._exit(EXIT_RUNTIME)

    def run(self) -> None:
        ops_thread = threading.Thread(target=self.loop.run_forever, name="rltool-ops",
                                      daemon=True)
        ops_thread.start()
        self.sched.start()
        threading.Thread(target=self.watch_scheduler, name="rltool-watch", daemon=True).start()
        self.channel.send({"t": "hello", "facts": EngineInfo.of_runner(self.runner).facts(),
                           "weight_version": self.runner.weight_version, "pid": os.getpid()})
        try:
            while (msg := self.channel.recv()) is not None and msg["t"] != "stop":
                self.dispatch(msg)
        finally:
            self.stopping.set()  # before the stop, which the watch must not take for a death
            self.sched.stop()
            self.loop.call_soon_threadsafe(self.loop.stop)
            ops_thread.join(timeout=5.0)

    def dispatch(self, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "submit":
            self.submit([ipc.decode_request(d) for d in msg["reqs"]],
                        streamed={d["rid"] for d in msg["reqs"] if d["stream"]})
        elif kind == "abort":
            sched, rids = self.sched, msg["rids"]
            try:
                sched.call(lambda: sched.abort_requests(rids))
            except EngineError:  # shutting down: every request is being aborted anyway
                pass
        elif kind == "call":
            asyncio.run_coroutine_threadsafe(self.call(msg["id"], msg["op"], msg["kw"]),
                                             self.loop)
        else:
            raise ValueError(f"unknown message {kind!r} on the scheduler channel")

    def submit(self, reqs: list[Request], *, streamed: set[str]) -> None:
        lora = self.runner.lora
        for req in reqs:
            req.on_finish = self.outbox.finished
            if req.rid in streamed:
                self.outbox.stream(req)
        try:
            if lora is not None:
                for req in reqs:
                    lora.check_name(req.lora)
            self.sched.submit(reqs)
        except Exception as e:  # noqa: BLE001 - refused: the front end answers the client
            self.outbox.unstream(reqs)
            self.channel.send({"t": "refused", "rids": [r.rid for r in reqs],
                               "err": ipc.error_of(e)})

    async def call(self, call_id: int, op: str, kwargs: dict[str, Any]) -> None:
        try:
            if op not in EngineOps.NAMES:
                raise ValueError(f"unknown operation {op!r}")
            reply = {"t": "reply", "id": call_id, "ok": await getattr(self.ops, op)(**kwargs)}
        except Exception as e:
            if not isinstance(e, (BadInputError, EngineError)):
                log.exception("operation %s failed", op)
            reply = {"t": "reply", "id": call_id, "err": ipc.error_of(e)}
        try:
            self.channel.send(reply)
        except OSError:
            pass  # the front end is gone
        except Exception as e:  # an answer JSON does not take: the caller gets the error
            log.exception("the answer of operation %s cannot be sent", op)
            with contextlib.suppress(OSError):
                self.channel.send({"t": "reply", "id": call_id, "err": ipc.error_of(e)})


def main(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)  # programs this process starts must not hold the channel open
    channel = ipc.Channel(sock)
    first = channel.recv()
    if first is None or first["t"] != "config":
        return 2
    cfg = ServeConfig.model_validate(first["cfg"])
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s [scheduler] %(name)s: %(message)s")
    if cfg.num_threads > 0:
        import torch

        torch.set_num_threads(cfg.num_threads)
    from rltool.engine.server import build_engine

    try:
        runner, scheduler = build_engine(cfg)
    except Exception as e:
        if not isinstance(e, RltoolError):  # a typed error is one line, told by the front end
            log.exception("building the engine failed")
        channel.send({"t": "fail", "err": ipc.error_of(e)})
        return 3
    SchedulerProcess(cfg, channel, runner, scheduler).run()
    return 0


if __name__ == "__main__":
    exit_now(main(int(sys.argv[1])))
