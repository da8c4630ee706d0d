"""Client-side routing over several engines (or one gateway): balancing, stickiness, re-dispatch.

- Bounded concurrency: at most `concurrency` requests in flight per engine; the rest wait here.
- Unkeyed requests go to the live engine with the fewest outstanding requests; the choice is made
  when a slot frees, so a backlog drains to whichever engine is fastest. Ties rotate.
- Keyed requests (a multi-turn session id) use consistent hashing: the key is hashed onto a ring of
  150 virtual nodes per engine URL and walked clockwise to the first live engine, so the same
  session lands on the same engine (its KV prefix cache is reused) and only a dead engine's keys move.
- When a request fails with an EngineError the engine is probed (`/health`); if it does not answer
  it is marked dead and the request is re-dispatched to another engine (the conversation is carried
  as token ids, so any engine can continue it). If the engine is healthy, the error belongs to the
  request and is raised. When no engine is left, EngineError is raised.
- Behind a gateway (`--router URL`) there is one "engine"; keys travel as `X-SMG-Routing-Key`
  (EngineClient's `routing_key`), and the gateway does the balancing and fail-over.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from rltool.errors import EngineError

log = logging.getLogger(__name__)
VIRTUAL_NODES = 150
HEALTH_PROBE_TIMEOUT_S = 5.0


class Transport(Protocol):
    """What the router needs from an engine client (rltool.rollout.client.EngineClient has it)."""

    async def generate(self, payload: dict, *, routing_key: str | None = None) -> Any: ...

    async def health(self) -> Any: ...

    async def abort_request(self, *, rid: str = "", abort_all: bool = False) -> Any: ...

    async def aclose(self) -> None: ...


@dataclass
class Engine:
    url: str
    client: Transport
    active: int = 0
    alive: bool = True
    requests: int = 0
    in_flight: set[str] = field(default_factory=set)
    waiting: deque[asyncio.Future] = field(default_factory=deque)  # keyed requests for it


def abort_response(message: str) -> dict[str, Any]:
    """A /generate answer for a request aborted before it reached an engine (no tokens)."""
    return {"text": "", "output_ids": [], "meta_info": {
        "finish_reason": {"type": "abort", "message": message, "status_code": None,
                          "err_type": None},
        "output_token_logprobs": [], "weight_version": None}}


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class Router:
    """Dispatch generate requests over engines; see the module docstring for the policy."""

    def __init__(self, engines: dict[str, Transport], *, concurrency: int, via_gateway: bool = False):
        if not engines:
            raise ValueError("Router needs at least one engine")
        self.engines = [Engine(url=url, client=c) for url, c in engines.items()]
        self.concurrency = concurrency
        self.via_gateway = via_gateway
        self.redispatched = 0
        self._turn = 0
        self._waiting: deque[asyncio.Future] = deque()  # unkeyed requests waiting for a slot
        self._aborted: set[str] = set()
        ring = sorted((_hash64(f"{e.url}#{i}"), idx) for idx, e in enumerate(self.engines)
                      for i in range(VIRTUAL_NODES))
        self._ring_hashes = [h for h, _ in ring]
        self._ring_engines = [idx for _, idx in ring]

    @property
    def alive(self) -> list[Engine]:
        return [e for e in self.engines if e.alive]

    def pick(self, routing_key: str | None) -> Engine:
        """The engine a request should go to now (raises EngineError when none is alive).

        Keyed: the first live engine clockwise on the hash ring. Unkeyed: the live engine with
        the fewest active requests (ties rotate)."""
        alive = self.alive
        if not alive:
            raise EngineError("no live engine left (all failed their health probe); check the "
                              "engine logs and restart them")
        if routing_key and not self.via_gateway:
            start = bisect.bisect(self._ring_hashes, _hash64(routing_key))
            n = len(self._ring_engines)
            for step in range(n):
                engine = self.engines[self._ring_engines[(start + step) % n]]
                if engine.alive:
                    return engine
        least = min(e.active for e in alive)
        tied = [e for e in alive if e.active == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    async def _acquire(self, routing_key: str | None) -> Engine:
        # The engine is chosen when a slot is free, not when the request arrives, so a backlog
        # drains to whichever engine finishes first (true least-outstanding). Waiters queue per
        # engine (keyed) or in one queue (unkeyed) and a freed slot wakes exactly one of them, so
        # a backlog of thousands costs O(1) per request, not a thundering herd.
        woken = False
        while True:
            engine = self.pick(routing_key)
            if engine.active < self.concurrency:
                engine.active += 1
                return engine
            queue = engine.waiting if routing_key and not self.via_gateway else self._waiting
            waiter = asyncio.get_running_loop().create_future()
            if woken:
                queue.appendleft(waiter)  # keep its place: it was next before a newcomer won
            else:
                queue.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake(engine)  # pass on a wake-up this cancelled request received
                raise
            woken = True

    def _release(self, engine: Engine) -> None:
        engine.active -= 1
        self._wake(engine)

    def _wake(self, engine: Engine) -> None:
        """Hand a free slot of `engine` to one waiter: its own sessions first, then anyone."""
        for queue in (engine.waiting, self._waiting):
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    return

    def _mark_dead(self, engine: Engine) -> None:
        engine.alive = False
        while engine.waiting:  # its sessions re-pick: the ring moves them to a live engine
            waiter = engine.waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def generate(self, payload: dict, *, routing_key: str | None = None) -> tuple[Any, str]:
        """Send one /generate; returns (response, engine url). Re-dispatches away from dead engines."""
        rid = payload.get("rid")
        rids = [r for r in (rid if isinstance(rid, list) else [rid]) if r]  # a batch has a list
        while True:
            engine = await self._acquire(routing_key)
            if rids and all(r in self._aborted for r in rids):  # aborted while it waited
                self._release(engine)
                answer = abort_response("aborted before dispatch")
                return (answer if not isinstance(rid, list) else [answer] * len(rid)), engine.url
            engine.in_flight.update(rids)
            engine.requests += 1
            try:
                response = await engine.client.generate(payload, routing_key=routing_key)
                return response, engine.url
            except EngineError as e:
                if self.via_gateway or await self._healthy(engine):
                    raise
                if engine.alive:
                    self._mark_dead(engine)
                    log.warning("engine %s failed (%s) and does not answer /health; re-dispatching "
                                "its requests to the other engines", engine.url, e)
                self.redispatched += 1
            finally:
                engine.in_flight.difference_update(rids)
                self._release(engine)

    async def _healthy(self, engine: Engine) -> bool:
        if not engine.alive:
            return False
        try:
            result = await asyncio.wait_for(engine.client.health(), HEALTH_PROBE_TIMEOUT_S)
        except (EngineError, asyncio.TimeoutError, OSError):
            return False
        return result is not False

    async def abort(self, rids: set[str]) -> int:
        """Ask engines to abort these in-flight requests (they return their partial output)."""
        self._aborted |= rids
        count = 0
        for engine in self.alive:
            for rid in sorted(engine.in_flight & rids):
                try:
                    await engine.client.abort_request(rid=rid)
                    count += 1
                except EngineError as e:
                    log.warning("abort of %s on %s failed: %s", rid, engine.url, e)
        return count

    def stats(self) -> dict[str, Any]:
        return {"engines": {e.url: {"alive": e.alive, "requests": e.requests} for e in self.engines},
                "redispatched": self.redispatched}

    async def aclose(self) -> None:
        for engine in self.engines:
            await engine.client.aclose()
