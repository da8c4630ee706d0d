"""The asynchronous loop's rollout side: groups generated continuously on a thread of their own.

`RolloutStream` runs an event loop in a background thread. It starts groups at prompt stream
positions (0, 1, 2, ... cycling over the prompt file; positions to redo after a resume first)
whenever the staleness gate admits one, runs each through the rollout stage's collector (generate,
reward) and appends it, finished, to a queue in completion order. The coordinator takes batches
from that queue (`take`) while generation goes on.

Weight updates do not drain the engines. Around a load, the coordinator pauses them
(`/pause_generation` with the update mode) and continues them after:
- `in-place` (the engine's `in_place`): running requests keep their cache and tokens; later tokens come from the new
  version (the shard's per-token versions show the switch);
- `retract`: running requests drop their cache and are prefilled again, tokens kept, under the new
  weights;
- `abort`: running requests come back aborted; the stream requeues their samples from scratch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any

from rltool.errors import EngineError
from rltool.loop.async_staleness import StalenessGate
from rltool.rollout.generate import Sample
from rltool.rollout.stage import RolloutConfig, StageInputs

log = logging.getLogger(__name__)


def restart(sample: Sample) -> None:
    """Forget an aborted sample's partial response so it is generated again from its prompt."""
    sample.response, sample.response_token_ids, sample.rollout_logprobs = "", [], []
    sample.loss_mask, sample.weight_versions, sample.engine_urls = [], [], []
    sample.status, sample.finish_reason, sample.reward, sample.rewards = "pending", "", 0.0, None


class RolloutStream:
    """Continuous rollout over the engines, gated by `gate`; thread-safe towards the coordinator.

    `next_position`: the first fresh prompt position; `redo`: positions started before a crash
    whose groups were never trained (regenerated first)."""

    def __init__(self, cfg: RolloutConfig, *, gate: StalenessGate, engine_version: int,
                 next_position: int, redo: list[int]):
        self.cfg = cfg
        self.gate = gate
        self.inputs = StageInputs(cfg)
        self.cond = threading.Condition()
        self.ready: list[list[Sample]] = []
        self.in_flight: dict[int, list[Sample]] = {}
        self.redo = deque(sorted(redo))
        self.next_position = next_position
        self.engine_version = engine_version
        self.trainer_version = engine_version
        self.training = False
        self.requeued = 0  # aborted samples requeued since the last requeued_since_last_call
        self.output_tokens = 0
        self._stopping = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kick: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._thread_main, name="rltool-rollout",
                                        daemon=True)

    # ----- coordinator side ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self.cond:
            self._stopping = True
        self._wake()
        self._thread.join(timeout=30.0)

    def take(self, count: int, *, train_version: int
             ) -> tuple[list[list[Sample]], list[list[Sample]], float]:
        """Block until `count` groups young enough for `train_version` are finished; returns
        (those groups in completion order, groups dropped as too stale, seconds waited)."""
        t0 = time.perf_counter()
        dropped: list[list[Sample]] = []
        with self.cond:
            self.trainer_version, self.training = train_version, False
            while True:
                self._raise_error()
                keep, drop = self.gate.split(self.ready, train_version=train_version)
                dropped += drop
                self.ready = keep
                if len(keep) >= count:
                    batch, self.ready = keep[:count], keep[count:]
                    self.training = True
                    break
                self._wake()  # the trainer's version changed: the gate may admit more
                self.cond.wait(timeout=1.0)
        self._wake()
        return batch, dropped, time.perf_counter() - t0

    def set_versions(self, *, trainer_version: int, engine_version: int) -> None:
        """After a weight update: the engines serve `engine_version`, the trainer is at
        `trainer_version`. A batch already taken for that version (prepared while the trainer
        trained the previous one) still counts as being trained."""
        with self.cond:
            self.engine_version = engine_version
            if trainer_version > self.trainer_version:
                self.trainer_version, self.training = trainer_version, False
        self._wake()

    def requeued_since_last_call(self) -> int:
        with self.cond:
            count, self.requeued = self.requeued, 0
            return count

    def in_flight_samples(self) -> int:
        with self.cond:
            return sum(s.status == "pending" for g in self.in_flight.values() for s in g)

    def positions(self) -> tuple[list[int], int]:
        """(positions started and not yet taken, the next fresh position)."""
        with self.cond:
            held = [g[0].group_id for g in self.ready] + list(self.in_flight)
            return sorted(held + list(self.redo)), self.next_position

    def _raise_error(self) -> None:
        if self._error is not None:
            raise EngineError(f"the rollout stream failed: {self._error}") from self._error

    def _wake(self) -> None:
        loop, kick = self._loop, self._kick
        if loop is not None and kick is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(kick.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

    # ----- the stream's own thread ---------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # handed to the coordinator by take()
            log.exception("rollout stream failed")
            with self.cond:
                self._error = e
                self.cond.notify_all()

    async def _main(self) -> None:
        from rltool.rollout.collect import Collector

        self._loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        router = self.inputs.make_router(self.cfg)
        collector = Collector(router=router, tokenizer=self.inputs.tokenizer,
                              generate_fn=self.inputs.generate_fn, sampling=self.cfg.sampling(),
                              reward_fn=self.inputs.reward_fn,
                              reward_timeout_s=self.cfg.reward_timeout_s,
                              reward_workers=self.cfg.reward_workers,
                              request_fields=self.cfg.request_fields(),
                              samples_per_request=self.cfg.samples_per_request)
        tasks: set[asyncio.Task] = set()
        try:
            async with collector.streaming():
                while True:
                    self._kick.clear()
                    with self.cond:
                        if self._stopping:
                            break
                        starts = self._admit()
                    if starts:  # the groups admitted together go to the engine together
                        task = asyncio.create_task(self._run_groups(collector, starts))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    await self._kick.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await router.aclose()

    def _admit(self) -> list[int]:
        """Positions to start now (called under the lock)."""
        starts = []
        while self.gate.admit(engine_version=self.engine_version,
                              trainer_version=self.trainer_version, training=self.training,
                              ahead=len(self.ready) + len(self.in_flight)):
            if self.redo:
                position = self.redo.popleft()
            else:
                position, self.next_position = self.next_position, self.next_position + 1
            # The uids (and so the sampling seeds) the synchronous loop gives this position.
            self.in_flight[position] = self.inputs.new_group(
                position, n=self.cfg.n_samples_per_prompt,
                uid_prefix=f"s{position // self.cfg.rollout_batch_size:06d}")
            starts.append(position)
        return starts

    async def _run_groups(self, collector: Any, positions: list[int]) -> None:
        """The groups at `positions`, generated together; each joins `ready` when it and its
        restarts (samples an abort sent back) are finished, in position order."""
        try:
            todo = {p: self.in_flight[p] for p in positions}
            while todo:
                before = collector.output_tokens
                done = dict(zip(todo, await collector.run_groups(list(todo.values()))))
                aborted = {p: [s for s in samples if s.status == "aborted"]
                           for p, samples in done.items()}
                with self.cond:
                    self.output_tokens += collector.output_tokens - before
                    self.requeued += sum(map(len, aborted.values()))
                    for p, samples in done.items():
                        if not aborted[p]:
                            self.in_flight.pop(p, None)
                            self.ready.append(samples)
                    self.cond.notify_all()
                todo = {p: done[p] for p in done if aborted[p]}
                for s in (s for p in todo for s in aborted[p]):
                    restart(s)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the coordinator re-raises it
            log.exception("groups at positions %s failed", positions)
            with self.cond:
                self._error = e
                self.cond.notify_all()
        finally:
            self._wake()
