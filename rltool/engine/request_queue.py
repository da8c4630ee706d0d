"""Requests from arrival to finish, on the scheduler (rltool.engine.scheduler): the queue other
threads submit to, admission, the tokens a step records and the requests they stop, control
operations (pause, abort, weight updates, cache flush, retraction) and the engine's counters.

States: `waiting` (sorted by arrival) -> `prefilling` -> `running` -> finished; retraction sends a
request back to `waiting`, its KV dropped and recomputed later. Other threads call only
`submit`, `call`, `update_weights`, `next_seq`, `request_stop` and `stats`; the rest runs on the
scheduler thread.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rltool.engine.detokenize import StreamedText
from rltool.engine.final_logprobs import recompute_logprobs
from rltool.engine.kv_memory import check_fits
from rltool.engine.request import Request
from rltool.engine.schedule_policy import SCHEDULE_POLICIES, ordered
from rltool.engine.scheduler import PAUSE_MODES, THROUGHPUT_WINDOW_S, QueueFullError
from rltool.engine.stop_rule import StopRule, StopText
from rltool.errors import BadInputError, EngineError

log = logging.getLogger(__name__)


@dataclass
class Counters:
    """The engine's counters (read by other threads as plain values; exactness under races is
    not needed). The batch builder counts forwards, the queue tokens and retractions."""

    max_decode_batch: int = 0
    num_decode_forwards: int = 0
    num_decode_rows: int = 0  # requests summed over decode and mixed forwards
    num_mixed_forwards: int = 0  # prefill forwards that also decoded the running requests
    num_prefill_forwards: int = 0
    num_prefill_tokens: int = 0  # prompt tokens whose KV a prefill forward computed
    total_output_tokens: int = 0
    num_retractions: int = 0


def _abort(message: str, status_code: int | None = None, err_type: str | None = None
           ) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


class RequestQueue:
    def __init__(self, runner: Any, *, max_running: int, max_queued: int, deterministic: bool,
                 schedule_policy: str = "fcfs"):
        if schedule_policy not in SCHEDULE_POLICIES:
            raise BadInputError(f"unknown --schedule-policy {schedule_policy!r}; choose fcfs or "
                                "lpm")
        self.runner = runner
        self.schedule_policy = schedule_policy
        self.max_running = max_running
        self.max_queued = max_queued
        self.deterministic = deterministic
        self.counters = Counters()
        self._cond = threading.Condition()
        self._incoming: list[Request] = []
        self._ops: list[tuple[Callable[[], None], concurrent.futures.Future]] = []
        self._seq = 0
        self.stopping = False
        # Owned by the scheduler thread:
        self.waiting: list[Request] = []  # sorted by seq
        self.prefilling: list[Request] = []
        self.running: dict[str, Request] = {}
        self.paused: str | None = None
        self.removals = 0  # requests that left `running` (finished or retracted), ever
        # (cutoff seq, apply, the caller's future): set by update_weights, run by the loop.
        self._pending_update: (tuple[int, Callable[[], None], concurrent.futures.Future]
                               | None) = None
        self._rids: set[str] = set()
        self._token_times: collections.deque[tuple[float, int]] = collections.deque()

    # ----- called from other threads -------------------------------------------------------

    def submit(self, reqs: list[Request]) -> None:
        """Queue requests (all or none). Raises QueueFullError / BadInputError / EngineError."""
        with self._cond:
            if self.stopping:
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
                check_fits(len(r.prompt_ids), r.params.max_new_tokens,
                           pool_tokens=self.runner.max_total_num_tokens)
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

        self._enqueue_op(op, future)
        return future

    def update_weights(self, apply: Callable[[], Any], *, abort_all: bool
                       ) -> concurrent.futures.Future:
        """Run `apply` (which swaps weights) when allowed: now if paused or idle, else once every
        request that arrived earlier has finished; then flush the prefix cache. Returns a future
        of `apply`'s result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        cutoff = self.next_seq() + 1

        def run() -> None:
            try:
                try:
                    result = apply()
                finally:  # KV computed under the old weights must never be reused
                    self.runner.flush_prefix_cache()
                future.set_result(result)
            except Exception as e:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(e)

        def op() -> None:
            if self._pending_update is not None:
                future.set_exception(BadInputError("another weight update is in progress"))
                return
            if abort_all:
                self.abort(abort_all=True)
            self._pending_update = (cutoff, run, future)

        self._enqueue_op(op, future)
        return future

    def _enqueue_op(self, op: Callable[[], None], future: concurrent.futures.Future) -> None:
        with self._cond:
            if self.stopping:
                raise EngineError("the engine is shutting down")
            self._ops.append((op, future))
            self._cond.notify_all()

    def next_seq(self) -> int:
        with self._cond:
            return self._seq

    def request_stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()

    def wait_for_work(self, can_step: Callable[[], bool]) -> list[Callable[[], None]] | None:
        """Block until there is something to do; move new arrivals to `waiting` and return the
        queued control operations (None once stopping)."""
        with self._cond:
            while not (self.stopping or self._incoming or self._ops or can_step()
                       or self.update_ready()):
                self._cond.wait(timeout=1.0)
            if self.stopping:
                return None
            for req in self._incoming:
                bisect.insort(self.waiting, req, key=lambda r: r.seq)
            self._incoming.clear()
            ops, self._ops = [op for op, _ in self._ops], []
            return ops

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        window = [n for t, n in list(self._token_times) if now - t <= THROUGHPUT_WINDOW_S]
        c = self.counters
        return {
            "num_running_reqs": len(self.running) + len(self.prefilling),
            "num_waiting_reqs": len(self.waiting) + len(self._incoming),
            "max_decode_batch_seen": c.max_decode_batch,
            "gen_throughput": sum(window) / THROUGHPUT_WINDOW_S,
            "total_output_tokens": c.total_output_tokens,
            "num_decode_forwards": c.num_decode_forwards,
            "num_decode_rows": c.num_decode_rows,
            "num_mixed_forwards": c.num_mixed_forwards,
            "mean_decode_batch": (c.num_decode_rows
                                  / max(c.num_decode_forwards + c.num_mixed_forwards, 1)),
            "num_prefill_forwards": c.num_prefill_forwards,
            "num_prefill_tokens": c.num_prefill_tokens,
            "num_retractions": c.num_retractions,
            "paused": self.paused,
            "deterministic": self.deterministic,
            "weights_released": self.runner.released,
        }

    # ----- scheduling (scheduler thread) ---------------------------------------------------

    def in_flight(self) -> list[Request]:
        return list(self.running.values()) + self.prefilling + self.waiting

    def admissible(self) -> list[Request]:
        """Waiting requests that may start: all, or those that arrived before a pending update."""
        if self._pending_update is None:
            return self.waiting
        cutoff = self._pending_update[0]
        return [r for r in self.waiting if r.seq < cutoff]

    def can_step(self) -> bool:
        if self.paused is not None or self.runner.released:
            return False
        return bool(self.running or self.prefilling or self.admissible())

    def update_ready(self) -> bool:
        if self._pending_update is None:
            return False
        if self.paused is not None:
            return True
        cutoff = self._pending_update[0]
        return not any(r.seq < cutoff for r in self.in_flight())

    def run_update(self) -> None:
        """Apply the pending weight update if nothing it waits for is in flight."""
        if self.update_ready():
            _, apply, _ = self._pending_update
            self._pending_update = None
            apply()

    def admit(self) -> None:
        """Move waiting requests to `prefilling`, in --schedule-policy order, while fewer than
        `max_running` are in flight."""
        runner = self.runner
        for req in ordered(self.admissible(), self.schedule_policy, runner.cached_prefix_length):
            if len(self.running) + len(self.prefilling) >= self.max_running:
                break
            self.waiting.remove(req)
            if req.params.max_new_tokens == 0:
                self.finish(req, {"type": "length", "length": 0})
            else:
                req.stop_rule = StopRule.for_request(
                    req.params, prompt_len=len(req.prompt_ids),
                    eos_token_ids=runner.eos_token_ids, context_length=runner.context_length)
                req.stop_text = StopText(runner.tokenizer, req.params.skip_special_tokens)
                if req.on_token is not None and req.streamed is None:
                    req.streamed = StreamedText(runner.tokenizer, req.params.skip_special_tokens)
                self.prefilling.append(req)

    def prefill_order(self) -> list[Request]:
        """`prefilling` in the order its chunks take the step's budget: requests already begun
        (a chunked prompt, cached pages claimed) first, then the others by --schedule-policy."""
        if self.schedule_policy == "fcfs":
            return list(self.prefilling)
        begun = [r for r in self.prefilling if r.num_cached]
        return begun + ordered([r for r in self.prefilling if not r.num_cached],
                               self.schedule_policy, self.runner.cached_prefix_length)

    def accept(self, reqs: list[Request], tokens: list[int], logprobs: list[float]) -> None:
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
            if req.stop_rule.may_stop(len(out), token) or req.on_token is not None:
                self.after_token(req, token)
        self.count_tokens(len(reqs), now)

    def count_tokens(self, n: int, now: float) -> None:
        self.counters.total_output_tokens += n
        self._token_times.append((now, n))
        while self._token_times and now - self._token_times[0][0] > THROUGHPUT_WINDOW_S:
            self._token_times.popleft()

    def after_token(self, req: Request, token: int) -> None:
        """Finish the request if `token` stops it, else hand the new token to a streaming caller
        with its text so far (its whole characters, decoded incrementally: `req.streamed`)."""
        stop = req.stop_rule.reason(len(req.output_ids), token,
                                    lambda: req.stop_text.read(req.output_ids))
        if stop is not None:
            reason, req.matched_stop_at = stop
            self.finish(req, reason)
        elif req.on_token is not None:
            req.text = req.streamed.update(req.output_ids)
            req.on_token(req)

    def finish(self, req: Request, reason: dict[str, Any]) -> None:
        """End the request: free its KV, fill in its logprobs and text, call its on_finish."""
        if req.finished:
            return
        runner = self.runner
        routed = getattr(runner.pool, "routed", None)  # an MoE model's, while loaded
        if req.return_routed_experts and routed is not None:
            # every token whose KV was computed (all but the last sampled), as SGLang does
            req.routed_experts = routed.read(runner.table, req.rid, req.prefill_target)
        self.removals += 1
        runner.remove(req.rid)
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
                with runner.invariant():  # the log-softmax too, as the trainer computes it
                    recompute_logprobs(runner, req, deterministic=self.deterministic)
            except Exception as e:
                # Never hand back sampling-time values in place of the recomputed ones the
                # client asked for: fail the request (HTTP 500 with the reason) instead.
                log.exception("recomputing logprobs for %s failed", req.rid)
                req.finish_reason = {"type": "abort", "status_code": 500,
                                     "message": f"logprob recompute failed: {type(e).__name__}: "
                                                f"{e}", "err_type": type(e).__name__}
        text = runner.tokenizer.decode(req.output_ids,
                                       skip_special_tokens=req.params.skip_special_tokens)
        req.text = text if req.matched_stop_at is None else text[:req.matched_stop_at]
        req.t_finish = time.monotonic()
        runner.tier_stats.record_request(req)
        if req.on_finish is not None:
            req.on_finish(req)

    def abort_where(self, match: Callable[[Request], bool], message: str,
                    status_code: int | None = None, err_type: str | None = None) -> int:
        """Finish the requests in flight that `match` picks as aborted (`message`); how many."""
        victims = [r for r in self.in_flight() if match(r)]
        for req in victims:
            self.finish(req, _abort(message, status_code, err_type))
        return len(victims)

    def shut_down(self) -> None:
        """After the loop: abort what is in flight or queued; fail the operations not run (503)."""
        with self._cond:
            pending, self._incoming = self._incoming, []
            ops, self._ops = self._ops, []
        for req in self.in_flight() + pending:
            self.finish(req, _abort("The engine is shutting down.", 503))
        for future in [f for _, f in ops] + [u[2] for u in [self._pending_update] if u]:
            if future.set_running_or_notify_cancel():  # not given up by its caller
                future.set_exception(EngineError("the engine is shutting down"))

    # ----- control operations (scheduler thread) -------------------------------------------

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise BadInputError(f"unknown pause mode {mode!r}; choose one of {PAUSE_MODES}")
        if mode == "abort":
            self.abort_where(lambda r: True, "Generation paused (abort).")
        elif mode == "retract":
            self.retract_all()
        self.paused = mode

    def resume_generation(self) -> None:
        self.paused = None

    def abort(self, *, rid: str = "", abort_all: bool = False) -> int:
        """/abort_request: abort the requests whose id starts with `rid` (SGLang's), or all."""
        if not rid and not abort_all:
            return 0
        return self.abort_where(lambda r: abort_all or r.rid.startswith(rid),
                                "Aborted by /abort_request.")

    def flush_cache(self) -> None:
        self.runner.flush_prefix_cache()

    def retract(self, req: Request) -> None:
        """Send a running request back to `waiting`, dropping its KV (recomputed later)."""
        self.removals += 1
        self.runner.remove(req.rid)
        self.running.pop(req.rid, None)
        req.reset_cache()
        bisect.insort(self.waiting, req, key=lambda r: r.seq)
        self.counters.num_retractions += 1

    def retract_all(self) -> None:
        """Move running and prefilling requests back to the waiting queue, dropping their KV."""
        self.removals += 1
        self.runner.clear()
        for req in list(self.running.values()) + self.prefilling:
            req.reset_cache()
            bisect.insort(self.waiting, req, key=lambda r: r.seq)
        self.running.clear()
        self.prefilling.clear()
