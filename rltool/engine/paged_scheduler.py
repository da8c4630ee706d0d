"""The scheduler over a paged runner (rltool.engine.paged_runner): the thread that owns the model,
running control operations and steps, over a request queue (rltool.engine.request_queue) and a
batch builder (rltool.engine.batch_builder). The calls other code makes (the HTTP routes, the
server, the in-process engine) are this class's public methods, forwarded to the part that does
the work. Safe from any thread: `submit`, `call`, `update_weights`, `next_seq`, `stats`, `alive`
and the thread lifecycle. On the scheduler thread only (inside `call`): `pause`,
`resume_generation`, `abort`, `flush_cache`, `retract_for_release`; the request lists are read
there too.

One iteration of the thread: wait for work; record any decode block still in flight if control
operations are queued; run them; apply a pending weight update once nothing it waits for is in
flight; run a step. A failed step aborts every request in flight (HTTP 500) and the thread goes
on; stopping aborts what is in flight or queued and fails the operations not run (503).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from rltool.engine.batch_builder import BatchBuilder
from rltool.engine.request import Request
from rltool.engine.request_queue import RequestQueue

log = logging.getLogger(__name__)


class PagedScheduler:
    def __init__(self, runner: Any, *, max_running: int = 64, max_queued: int = 4096,
                 max_prefill_tokens: int = 512, chunked_prefill_size: int | None = None,
                 deterministic: bool = False, overlap: bool = True,
                 num_continuous_decode_steps: int = 1, schedule_policy: str = "fcfs",
                 enable_mixed_chunk: bool = False):
        self.runner = runner
        self.queue = RequestQueue(runner, max_running=max_running, max_queued=max_queued,
                                  deterministic=deterministic, schedule_policy=schedule_policy)
        self.batch = BatchBuilder(runner, self.queue, max_running=max_running,
                                  max_prefill_tokens=max_prefill_tokens,
                                  chunked_prefill_size=chunked_prefill_size,
                                  deterministic=deterministic, overlap=overlap,
                                  num_continuous_decode_steps=num_continuous_decode_steps,
                                  enable_mixed_chunk=enable_mixed_chunk)
        self.counters = self.queue.counters
        # Called on the scheduler thread after every iteration and once after shutting down:
        # the scheduler process sends what the iteration produced (rltool.engine.scheduler_process).
        self.on_iteration: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None
        # torch's intra-op thread setting does not carry over to new threads in full: without
        # setting it again on the scheduler thread, small ops ran ~12x slower there (measured).
        self._num_threads = torch.get_num_threads()

    # ----- thread lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rltool-scheduler", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Start shutting down without waiting: in-flight requests are aborted (status 503)."""
        self.queue.request_stop()

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Abort everything in flight and end the thread."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.queue.stopping

    def _loop(self) -> None:
        torch.set_num_threads(self._num_threads)
        queue, batch = self.queue, self.batch
        while True:
            ops = queue.wait_for_work(batch.can_step)
            if ops is None:
                break
            try:
                if ops or queue.update_ready():
                    batch.blocks.drain()  # control operations see every sampled token recorded
                for op in ops:
                    op()
                queue.run_update()
                if batch.can_step():
                    batch.step()
            except Exception as e:  # a failed forward must not kill the server silently
                log.exception("scheduler step failed; aborting in-flight requests")
                queue.abort_where(lambda r: True, f"engine error: {e}", 500, type(e).__name__)
            if self.on_iteration is not None:
                self.on_iteration()
        queue.shut_down()
        if self.on_iteration is not None:
            self.on_iteration()

    # ----- the calls other code makes -------------------------------------------------------

    def submit(self, reqs: list[Request]) -> None:
        """Queue requests (all or none). Raises QueueFullError / BadInputError / EngineError."""
        self.queue.submit(reqs)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the scheduler thread between steps; the future gets its result or error."""
        return self.queue.call(fn)

    def next_seq(self) -> int:
        return self.queue.next_seq()

    def update_weights(self, apply: Callable[[], Any], *, abort_all: bool
                       ) -> concurrent.futures.Future:
        return self.queue.update_weights(apply, abort_all=abort_all)

    def pause(self, mode: str) -> None:
        self.queue.pause(mode)

    def resume_generation(self) -> None:
        self.queue.resume_generation()

    def abort(self, *, rid: str = "", abort_all: bool = False) -> int:
        return self.queue.abort(rid=rid, abort_all=abort_all)

    def abort_requests(self, rids: list[str]) -> None:
        """Abort exactly these requests (their client went away or their answer failed), never
        another whose id merely starts with one of them."""
        wanted = set(rids)
        self.queue.abort_where(lambda r: r.rid in wanted, "Aborted: its client went away.")

    def flush_cache(self) -> None:
        self.queue.flush_cache()

    def retract_for_release(self) -> None:
        self.queue.retract_all()

    def stats(self) -> dict[str, Any]:
        return {**self.queue.stats(), **self.batch.blocks.stats(),
                "compiles_since_warmup": self.runner.compiles.since_warmup()}

    @property
    def running(self) -> dict[str, Request]:
        return self.queue.running

    @property
    def prefilling(self) -> list[Request]:
        return self.queue.prefilling

    @property
    def waiting(self) -> list[Request]:
        return self.queue.waiting

    @property
    def paused(self) -> str | None:
        return self.queue.paused

    # ----- counters (benchmarks and tests read them) ---------------------------------------

    @property
    def max_decode_batch(self) -> int:
        return self.counters.max_decode_batch

    @property
    def num_decode_forwards(self) -> int:
        return self.counters.num_decode_forwards

    @property
    def num_prefill_forwards(self) -> int:
        return self.counters.num_prefill_forwards

    @property
    def num_prefill_tokens(self) -> int:
        return self.counters.num_prefill_tokens

    @property
    def total_output_tokens(self) -> int:
        return self.counters.total_output_tokens

    @property
    def num_retractions(self) -> int:
        return self.counters.num_retractions
