"""The device-independent half of the engine's scheduler: one thread owns the model and runs
steps; requests, admission, control operations and request accounting live here, and the paged
scheduler (rltool.engine.paged_scheduler) says how a step touches the KV cache and samples.

A step: (1) admit waiting requests while fewer than `max_running` are in flight; (2) prefill prompt
chunks; (3) one decode step for every running request, then retire the finished ones. Requests
join and leave only at step boundaries.

Control operations (pause, weights, memory, abort) are closures queued to the same thread and run
between steps, so the model is never touched by two threads. `update_weights` without a pause
waits until every request that arrived before it has finished, and holds back later arrivals
meanwhile (SGLang's writer lock).
"""

from __future__ import annotations

import abc
import bisect
import collections
import concurrent.futures
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rltool.errors import BadInputError, EngineError
from rltool.engine.request import Request

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache")
THROUGHPUT_WINDOW_S = 10.0


class QueueFullError(EngineError):
    """More than --max-queued-requests are waiting (HTTP 429)."""


class Scheduler(abc.ABC):
    def __init__(self, runner: Any, *, max_running: int = 64, max_queued: int = 4096,
                 max_prefill_tokens: int = 512, chunked_prefill_size: int | None = None,
                 deterministic: bool = False, decode_log_size: int = 256):
        self.runner = runner
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_prefill_tokens = max_prefill_tokens  # prompt tokens per step
        self.chunked_prefill_size = chunked_prefill_size or max_prefill_tokens  # one chunk
        self.deterministic = deterministic
        self._cond = threading.Condition()
        self._incoming: list[Request] = []
        self._ops: list[Callable[[], None]] = []
        self._seq = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Owned by the scheduler thread:
        self.waiting: list[Request] = []  # sorted by seq
        self.prefilling: list[Request] = []
        self.running: dict[str, Request] = {}
        self.paused: str | None = None
        # (cutoff seq, apply, the caller's future): set by update_weights, run by the loop.
        self._pending_update: (tuple[int, Callable[[], None], concurrent.futures.Future]
                               | None) = None
        self._rids: set[str] = set()
        # Stats (read by other threads as plain values; exactness under races is not needed).
        self.max_decode_batch = 0
        self.num_decode_forwards = 0
        self.num_prefill_forwards = 0
        self.num_prefill_tokens = 0  # prompt tokens whose KV a prefill forward computed
        self.total_output_tokens = 0
        self.decode_log: collections.deque[list[str]] = collections.deque(maxlen=decode_log_size)
        self._token_times: collections.deque[tuple[float, int]] = collections.deque()
        # torch's intra-op thread setting does not carry over to new threads in full: without
        # setting it again on the scheduler thread, small ops ran ~12x slower there (measured).
        self._num_threads = torch.get_num_threads()

    # ----- thread lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rltool-scheduler", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Start shutting down without waiting: in-flight requests are aborted (status 503)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Abort everything in flight and end the thread."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # ----- called from other threads -------------------------------------------------------

    def submit(self, reqs: list[Request]) -> None:
        """Queue requests (all or none). Raises QueueFullError / BadInputError / EngineError."""
        with self._cond:
            if self._stopping:
                raise EngineError("the engine is shutting down")
            queued = len(self._incoming) + len(self.waiting)
            if queued + len(reqs) > self.max_queued + self.max_running:
                raise QueueFullError(f"{queued} requests are queued; the engine takes at most "
                                     f"{self.max_queued} beyond {self.max_running} running")
            rids = [r.rid for r in reqs]
            dup = next((r for r in rids if r in self._rids), None)
            if dup is not None or len(set(rids)) != len(rids):
                raise BadInputError(f"duplicate request id {dup or rids[0]!r}")
            for r in reqs:
                self._seq += 1
                r.seq = self._seq
                self._rids.add(r.rid)
            self._incoming.extend(reqs)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the scheduler thread between steps; the future gets its result or error."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def op() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:  # noqa: BLE001 - handed to the caller through the future
                    future.set_exception(e)

        self._enqueue_op(op)
        return future

    def _enqueue_op(self, op: Callable[[], None]) -> None:
        with self._cond:
            if self._stopping:
                raise EngineError("the engine is shutting down")
            self._ops.append(op)
            self._cond.notify_all()

    def next_seq(self) -> int:
        with self._cond:
            return self._seq

    # ----- control operations (scheduler thread) -------------------------------------------

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise BadInputError(f"unknown pause mode {mode!r}; choose one of {PAUSE_MODES}")
        if mode == "abort":
            for req in self._in_flight():
                self._finish(req, {"type": "abort", "message": "Generation paused (abort).",
                                   "status_code": None, "err_type": None})
        elif mode == "retract":
            self._retract_all()
        self.paused = mode

    def resume_generation(self) -> None:
        self.paused = None

    def abort(self, *, rid: str = "", abort_all: bool = False) -> int:
        """Abort requests whose id starts with `rid` (SGLang's matching), or all of them."""
        if not rid and not abort_all:
            return 0
        victims = [r for r in self._in_flight() if abort_all or r.rid.startswith(rid)]
        for req in victims:
            self._finish(req, {"type": "abort", "message": "Aborted by /abort_request.",
                               "status_code": None, "err_type": None})
        return len(victims)

    def update_weights(self, apply: Callable[[], Any], *, abort_all: bool) -> concurrent.futures.Future:
        """Run `apply` (which swaps weights) when allowed: now if paused or idle, else once every
        request that arrived earlier has finished. Returns a future of `apply`'s result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        cutoff = self.next_seq() + 1

        def run() -> None:
            try:
                future.set_result(apply())
            except Exception as e:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(e)

        def op() -> None:
            if self._pending_update is not None:
                future.set_exception(BadInputError("another weight update is in progress"))
                return
            if abort_all:
                self.abort(abort_all=True)
            self._pending_update = (cutoff, run, future)

        self._enqueue_op(op)
        return future

    def retract_for_release(self) -> None:
        self._retract_all()

    def idle(self) -> bool:
        return not (self.running or self.prefilling or self.waiting or self._incoming)

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        window = [n for t, n in list(self._token_times) if now - t <= THROUGHPUT_WINDOW_S]
        return {
            "num_running_reqs": len(self.running) + len(self.prefilling),
            "num_waiting_reqs": len(self.waiting) + len(self._incoming),
            "max_decode_batch_seen": self.max_decode_batch,
            "gen_throughput": sum(window) / THROUGHPUT_WINDOW_S,
            "total_output_tokens": self.total_output_tokens,
            "num_decode_forwards": self.num_decode_forwards,
            "num_prefill_forwards": self.num_prefill_forwards,
            "num_prefill_tokens": self.num_prefill_tokens,
            "paused": self.paused,
            "deterministic": self.deterministic,
            "weights_released": self.runner.released,
            "decode_batches": [list(b) for b in list(self.decode_log)],
        }

    # ----- the loop ------------------------------------------------------------------------

    def _in_flight(self) -> list[Request]:
        return list(self.running.values()) + self.prefilling + self.waiting

    def _can_step(self) -> bool:
        if self.paused is not None or self.runner.released:
            return False
        return bool(self.running or self.prefilling or self._admissible())

    def _admissible(self) -> list[Request]:
        if self._pending_update is None:
            return self.waiting
        cutoff = self._pending_update[0]
        return [r for r in self.waiting if r.seq < cutoff]

    def _loop(self) -> None:
        torch.set_num_threads(self._num_threads)
        while True:
            with self._cond:
                while not (self._stopping or self._incoming or self._ops or self._can_step()
                           or self._update_ready()):
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    break
                for req in self._incoming:
                    bisect.insort(self.waiting, req, key=lambda r: r.seq)
                self._incoming.clear()
                ops, self._ops = self._ops, []
            try:
                if ops or self._update_ready():
                    self._quiesce()
                for op in ops:
                    op()
                if self._update_ready():
                    _, apply, _ = self._pending_update
                    self._pending_update = None
                    apply()
                if self._can_step():
                    self._step()
            except Exception as e:  # a failed forward must not kill the server silently
                log.exception("scheduler step failed; aborting in-flight requests")
                for req in self._in_flight():
                    self._finish(req, {"type": "abort", "message": f"engine error: {e}",
                                       "status_code": 500, "err_type": type(e).__name__})
        with self._cond:
            pending = self._incoming
            self._incoming = []
        for req in self._in_flight() + pending:
            self._finish(req, {"type": "abort", "message": "The engine is shutting down.",
                               "status_code": 503, "err_type": None})
        if self._pending_update is not None:
            self._pending_update[2].set_exception(EngineError("the engine shut down before the "
                                                              "weight update could run"))

    def _quiesce(self) -> None:
        """Before control operations: finish any step still running on the device (a runner
        that overlaps steps overrides this)."""

    def _update_ready(self) -> bool:
        if self._pending_update is None:
            return False
        if self.paused is not None:
            return True
        cutoff = self._pending_update[0]
        return not any(r.seq < cutoff for r in self._in_flight())

    def _step(self) -> None:
        for req in list(self._admissible()):
            if len(self.running) + len(self.prefilling) >= self.max_running:
                break
            self.waiting.remove(req)
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
            else:
                p = req.params
                stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos
                                                    else self.runner.eos_token_ids)
                req.stop_rule = (frozenset(stop_ids),
                                 min(p.max_new_tokens,
                                     self.runner.context_length - len(req.prompt_ids)),
                                 p.min_new_tokens, bool(p.stop or p.stop_regex))
                self.prefilling.append(req)
        self._prefill_step()
        if self.running:
            self._decode_step()

    @abc.abstractmethod
    def _prefill_step(self) -> None:
        """Prefill prompt chunks of `prefilling` requests; a request whose prompt is done samples
        its first token and joins `running`."""

    @abc.abstractmethod
    def _decode_step(self) -> None:
        """One decode step for every running request: sample, record, retire the finished."""

    def _accept(self, reqs: list[Request], tokens: list[int], logprobs: list[float]) -> None:
        """Record one sampled token per request (no top logprobs) and finish the requests it
        stops: the per-token host work of a decode step, kept to a few operations per request."""
        version = self.runner.weight_version
        now = time.monotonic()
        for req, token, logprob in zip(reqs, tokens, logprobs):
            out = req.output_ids
            if not out:
                req.t_first_token = now
            out.append(token)
            req.output_logprobs.append(logprob)
            spans = req.spans
            if not spans or spans[-1][0] != version:
                spans.append((version, len(out) - 1))
            stop_ids, limit, min_new, texty = req.stop_rule
            if len(out) >= limit or (len(out) >= min_new and (texty or token in stop_ids)) \
                    or req.on_token is not None:
                self._after_token(req, token)
        self._count_tokens(len(reqs), now)

    def _count_tokens(self, n: int, now: float) -> None:
        self.total_output_tokens += n
        self._token_times.append((now, n))
        while self._token_times and now - self._token_times[0][0] > THROUGHPUT_WINDOW_S:
            self._token_times.popleft()

    def _after_token(self, req: Request, token: int) -> None:
        """Finish the request if `token` stops it, else hand the new token to a streaming caller."""
        reason = self._stop_reason(req, token)
        if reason is not None:
            self._finish(req, reason)
        elif req.on_token is not None:
            req.text = self._decode_text(req)
            req.on_token(req)

    def _stop_reason(self, req: Request, token: int) -> dict[str, Any] | None:
        p = req.params
        n = len(req.output_ids)
        if n >= p.min_new_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.runner.eos_token_ids):
                return {"type": "stop", "matched": token}
            if p.stop or p.stop_regex:
                matched = self._match_stop(req)
                if matched is not None:
                    return {"type": "stop", "matched": matched}
        if n >= p.max_new_tokens or len(req.prompt_ids) + n >= self.runner.context_length:
            return {"type": "length", "length": n}
        return None

    def _match_stop(self, req: Request) -> str | None:
        text = self._decode_text(req)
        best: tuple[int, int, str] | None = None  # (start, length, what matched)
        for stop in req.params.stop:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, len(stop), stop)
        for pattern in req.params.stop_regex:
            m = re.search(pattern, text)
            if m is not None and (best is None or m.start() < best[0]):
                best = (m.start(), len(m.group(0)), pattern)
        if best is None:
            return None
        at, length, matched = best
        req.matched_stop_at = at + length if req.params.no_stop_trim else at
        return matched

    def _decode_text(self, req: Request) -> str:
        return self.runner.tokenizer.decode(
            req.output_ids, skip_special_tokens=req.params.skip_special_tokens)

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        if req.finished:
            return
        self.running.pop(req.rid, None)
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.finish_reason = reason
        req.reset_cache()
        self._rids.discard(req.rid)
        if reason.get("status_code") is None:  # a request failing anyway needs no logprobs
            try:
                self._final_logprobs(req)
            except Exception as e:
                # Never hand back sampling-time values in place of the recomputed ones the
                # client asked for: fail the request (HTTP 500 with the reason) instead.
                log.exception("recomputing logprobs for %s failed", req.rid)
                req.finish_reason = {"type": "abort", "status_code": 500,
                                     "message": f"logprob recompute failed: {type(e).__name__}: "
                                                f"{e}", "err_type": type(e).__name__}
        text = self._decode_text(req)
        req.text = text if req.matched_stop_at is None else text[:req.matched_stop_at]
        req.t_finish = time.monotonic()
        if req.on_finish is not None:
            req.on_finish(req)

    def _final_logprobs(self, req: Request) -> None:
        """Deterministic mode: logprobs from one unpadded pass (trainer layout); input logprobs."""
        if not req.return_logprob:
            return
        from rltool.logprobs import logits_to_logprobs

        temp = req.params.temperature
        ids = req.all_ids()
        wants_input = req.logprob_start_len >= 0
        recompute = self.deterministic and req.output_ids
        if not (recompute or wants_input):
            return
        if self.runner.released:
            raise EngineError("the weights are released (/release_memory_occupation); resume "
                              "them before asking for recomputed logprobs")
        start = max(req.logprob_start_len, 0) if wants_input else len(req.prompt_ids)
        first = max(start, 1)
        logits = self.runner.full_pass_logits(ids, start=first)
        targets = torch.tensor(ids[first:], device=logits.device)
        chosen = logits_to_logprobs(logits, targets, temperature=temp).tolist()
        n_prompt = len(req.prompt_ids)
        out_from = n_prompt - first
        if recompute:
            req.output_logprobs = chosen[out_from:]
            rows = torch.log_softmax(logits[out_from:].float() / _temp(temp), dim=-1)
            if req.top_logprobs_num > 0:
                values, idx = rows.topk(req.top_logprobs_num, dim=-1)
                req.output_top_logprobs = [list(zip(v, i)) for v, i in
                                           zip(values.tolist(), idx.tolist())]
            if req.token_ids_logprob:
                req.output_token_ids_logprobs = [[(float(row[t]), t) for t in req.token_ids_logprob]
                                                 for row in rows]
        if wants_input:
            # SGLang's shape: one entry per prompt position from `start`, the first one null.
            skip = 0 if start == 0 else 1
            req.input_logprobs = [None] + chosen[skip:out_from]
            if req.top_logprobs_num > 0:
                rows = torch.log_softmax(logits[skip:out_from].float() / _temp(temp), dim=-1)
                values, idx = rows.topk(req.top_logprobs_num, dim=-1)
                req.input_top_logprobs = [None] + [list(zip(v, i)) for v, i in
                                                   zip(values.tolist(), idx.tolist())]

    def _retract_all(self) -> None:
        """Move running and prefilling requests back to the waiting queue, dropping their KV."""
        for req in list(self.running.values()) + self.prefilling:
            req.reset_cache()
            bisect.insort(self.waiting, req, key=lambda r: r.seq)
        self.running.clear()
        self.prefilling.clear()


def _temp(temperature: float) -> float:
    from rltool.logprobs import effective_temperature

    return effective_temperature(temperature)
