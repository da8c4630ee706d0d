"""The asynchronous loop's evaluation path: a dedicated engine and a thread of its own.

The coordinator hands over a version (its weights: the published directory for a disk sync, a
copy of the trainer's tensors for an in-memory one) and goes on; the worker loads it into its
own engine and runs the eval stage on it, writing RUN/eval/step-V/ and an eval.jsonl row tagged
with that version (its `time` is the wall clock of the result). The training engines and the
training queue are never touched: eval prompts go only to the eval engine, and its samples only
to the eval shard.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from rltool import atomic
from rltool.data.shards import MANIFEST
from rltool.errors import EngineError
from rltool.loop import lora_sync
from rltool.loop.config import LoopSettings
from rltool.loop.engines import EngineSet
from rltool.rundir import RunDir

log = logging.getLogger(__name__)


class EvalWorker:
    def __init__(self, run: RunDir, settings: LoopSettings, engine: EngineSet, *, mode: str):
        self.run = run
        self.settings = settings
        self.engine = engine  # started by the worker on its first job, so a run killed before
        # its first evaluation never pays for it
        self.mode = mode  # "disk", "tensor" or "distributed": how the eval engine gets weights
        self.jobs: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        self.error: BaseException | None = None
        self.done: list[int] = []
        self._thread = threading.Thread(target=self._main, name="rltool-eval", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, version: int, named: list[tuple[str, Any]] | None) -> None:
        """Evaluate `version`; `named` holds its tensors for an in-memory sync (copied here so
        the trainer may go on changing its own)."""
        self.check()
        if (self.run.eval_step(version) / MANIFEST).exists():
            return  # evaluated before a resume
        copy = [(n, t.detach().clone()) for n, t in named] if named is not None else None
        self.jobs.put((version, copy))

    def finish(self) -> None:
        """Wait for every submitted evaluation, then raise the first error (if any)."""
        self.jobs.put(None)
        self._thread.join()
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise EngineError(f"evaluation failed: {self.error}") from self.error

    def _main(self) -> None:
        while (job := self.jobs.get()) is not None:
            if self.error is not None:
                continue
            try:
                self._evaluate(*job)
            except BaseException as e:  # raised in the coordinator by check()
                log.exception("evaluation of version %d failed", job[0])
                self.error = e

    def _evaluate(self, version: int, named: list[tuple[str, Any]] | None) -> None:
        from rltool.rollout.eval import run as run_eval

        if not self.engine.procs:
            from rltool.loop.affinity import pin_tree

            self.engine.start(self.run.weight_version(0))
            if self.settings.loop.engine_cores:
                pin_tree(self.engine.procs[0].pid, self.settings.loop.engine_cores)
        bucket = self.settings.sync.tensor_bucket_mb << 20
        if named is None:
            from rltool.loop.phases import version_mode

            self.engine.load_version(version, delta=version_mode(self.run.weight_version(version))
                                     == "delta")
        elif self.mode == "distributed":
            self.engine.load_distributed(named, version=version, bucket_bytes=bucket,
                                         lora_config=lora_sync.tensor_config(self.settings))
        else:
            self.engine.load_tensors(named, version=version, bucket_bytes=bucket,
                                     lora_config=lora_sync.tensor_config(self.settings))
        atomic.remove_stale_temporaries(self.run.eval)
        run_eval(self.settings.eval_config(self.run, step=version, urls=self.engine.urls,
                                           policy_version=version))
        self.done.append(version)
