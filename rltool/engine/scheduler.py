"""The engine's scheduler as the rest of the engine sees it: the calls the HTTP routes, the server
and the in-process engine make, the errors and names they share. One thread owns the model and
runs steps; the parts are

- `rltool.engine.request_queue.RequestQueue`: requests from arrival to finish (admission, the
  tokens each step records, the stop rule), control operations (pause, abort, weight updates,
  prefix-cache flush, retraction) and the counters of `stats()`;
- `rltool.engine.batch_builder.BatchBuilder`: what one step runs on the model runner (packed
  prefill chunks, a decode step, the sampling), with `rltool.engine.decode_overlap` for decode
  steps queued on the device ahead of the host;
- `rltool.engine.paged_scheduler.PagedScheduler`: the thread that runs them, and this interface.

A step: (1) admit waiting requests while fewer than `max_running` are in flight; (2) prefill prompt
chunks; (3) one decode step for every running request, then retire the finished ones. Requests
join and leave only at step boundaries.

Control operations (pause, weights, memory, abort) are closures queued to the same thread and run
between steps, so the model is never touched by two threads. `update_weights` without a pause
waits until every request that arrived before it has finished, and holds back later arrivals
meanwhile (SGLang's writer lock).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, Protocol

from rltool.engine.request import Request
from rltool.errors import EngineError

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache")
THROUGHPUT_WINDOW_S = 10.0


class QueueFullError(EngineError):
    """More than --max-queued-requests are waiting (HTTP 429)."""


class Scheduler(Protocol):
    """What other code calls. Safe from any thread: `submit`, `call`, `update_weights`,
    `next_seq`, `stats`, `alive` and the thread lifecycle. On the scheduler thread only (inside
    `call`): `pause`, `resume_generation`, `abort`, `flush_cache`, `retract_for_release`; the
    request lists are read there too."""

    @property
    def running(self) -> dict[str, Request]: ...

    @property
    def prefilling(self) -> list[Request]: ...

    @property
    def waiting(self) -> list[Request]: ...

    @property
    def paused(self) -> str | None: ...

    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...

    def request_stop(self) -> None: ...

    def stop(self, *, timeout_s: float = 10.0) -> None: ...

    def submit(self, reqs: list[Request]) -> None: ...

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future: ...

    def next_seq(self) -> int: ...

    def update_weights(self, apply: Callable[[], Any], *, abort_all: bool
                       ) -> concurrent.futures.Future: ...

    def pause(self, mode: str) -> None: ...

    def resume_generation(self) -> None: ...

    def abort(self, *, rid: str = "", abort_all: bool = False) -> int: ...

    def flush_cache(self) -> None: ...

    def retract_for_release(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...
