"""The engine's scheduler: the names and errors its parts and callers share, and how the parts fit.
One thread owns the model and runs steps; the parts are

- `rltool.engine.request_queue.RequestQueue`: requests from arrival to finish (admission, the
  tokens each step records, the stop rule), control operations (pause, abort, weight updates,
  prefix-cache flush, retraction) and the counters of `stats()`;
- `rltool.engine.batch_builder.BatchBuilder`: what one step runs on the model runner (packed
  prefill chunks, a decode step, the sampling), with `rltool.engine.decode_overlap` for decode
  steps queued on the device ahead of the host;
- `rltool.engine.paged_scheduler.PagedScheduler`: the thread that runs them, and the calls the
  HTTP routes, the server and the in-process engine make.

A step: (1) admit waiting requests while fewer than `max_running` are in flight; (2) prefill prompt
chunks; (3) one decode step for every running request, then retire the finished ones. Requests
join and leave only at step boundaries.

Control operations (pause, weights, memory, abort) are closures queued to the same thread and run
between steps, so the model is never touched by two threads. `update_weights` without a pause
waits until every request that arrived before it has finished, and holds back later arrivals
meanwhile (SGLang's writer lock).
"""

from __future__ import annotations

from rltool.errors import EngineError

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache")
THROUGHPUT_WINDOW_S = 10.0


class QueueFullError(EngineError):
    """More than --max-queued-requests are waiting (HTTP 429)."""
