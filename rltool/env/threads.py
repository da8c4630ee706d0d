"""Environment calls off the event loop, bounded in number and in time.

Each call runs in its own daemon thread, not in a thread pool: a pool's threads are joined when
the interpreter exits, so one environment stuck in an endless loop would keep `rltool rollout` or
`rltool env serve` from ever exiting. A call that times out is abandoned (Python cannot stop a
thread); its slot is given back, so it no longer counts against the limit.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from rltool.env.base import EnvTimeoutError


class CallLimiter:
    """At most `workers` environment calls at once, per event loop (the synchronous loop runs
    each rollout step on a new one)."""

    def __init__(self, workers: int):
        self.workers = workers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None

    def semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._semaphore is None:
            self._loop, self._semaphore = loop, asyncio.Semaphore(self.workers)
        return self._semaphore


async def call_in_thread(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str,
                         limiter: CallLimiter | None = None, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a daemon thread; EnvTimeoutError after `timeout_s` seconds."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the event loop is gone: nobody waits for this call any more

    semaphore = limiter.semaphore() if limiter is not None else None
    if semaphore is not None:
        await semaphore.acquire()
    try:
        threading.Thread(target=run, name=f"rltool-env-{what}", daemon=True).start()
        return await asyncio.wait_for(future, timeout_s)
    except asyncio.TimeoutError:
        raise EnvTimeoutError(f"{what} took more than {timeout_s:g}s") from None
    finally:
        if semaphore is not None:
            semaphore.release()
