"""`[loop] engine = "inprocess"`: the loop's one engine runs on a scheduler thread of the loop
process (rltool.engine.inprocess) instead of as an `rltool serve` child.

The rollout and eval stages call it directly (no HTTP, no JSON, no per-step /get_model_info
round trip), and a weight sync is one copy of the resident trainer's tensors into the engine's
parameters, applied between scheduler steps. Nothing goes into engines.json: the engine ends with
the loop process, so a killed loop leaves no orphan, and `--resume` starts a fresh one like any
other engine. Memory release and resume are direct calls (the colocated loop on CUDA frees the
device for the trainer); disk and distributed weight loads have no in-process form, so the config
allows only the in-memory sync (`LoopSettings.serve_config`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rltool import trace
from rltool.engine.config import ServeConfig
from rltool.errors import EngineError
from rltool.loop.engines import ChildRegistry, EngineSet
from rltool.rundir import RunDir


class InProcessEngines(EngineSet):
    """One `InProcessEngine` behind the EngineSet calls the colocated in-memory loop makes."""

    def __init__(self, run: RunDir, registry: ChildRegistry, *, serve_config: ServeConfig,
                 ready_timeout_s: float):
        super().__init__(run, registry, num_engines=1, engine_args=[],
                         deterministic=serve_config.deterministic,
                         ready_timeout_s=ready_timeout_s)
        self.serve_config = serve_config
        self.engine: Any = None

    @property
    def urls(self) -> list[str]:
        return [self.engine.url] if self.engine is not None else []

    @property
    def clients(self) -> dict[str, Any] | None:
        return {self.engine.url: self.engine} if self.engine is not None else None

    def start(self, model_dir: Path) -> None:
        from rltool.engine.inprocess import InProcessEngine

        with trace.span("engine_start", cat="wait", engine=0):
            self.engine = InProcessEngine(self.serve_config.model_copy(
                update={"model": Path(model_dir)}))

    def check_alive(self) -> None:
        if self.engine is None or not self.engine.scheduler.alive:
            raise EngineError("the in-process engine's scheduler has stopped (its error is in the "
                              f"loop's log); `rltool loop --resume {self.run.root}`")

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.engine = None

    @property
    def device(self) -> str:
        return self.serve_config.engine_device

    @property
    def dtype(self) -> Any:
        from rltool.config import torch_dtype_name
        from rltool.delta.tensor_sync import dtype_of

        return dtype_of(torch_dtype_name(self.serve_config.dtype))

    def release_memory(self) -> None:
        self.check_alive()
        with trace.span("offload", cat="memory"):
            self.engine.release_memory()

    def resume_memory(self) -> None:
        self.check_alive()
        with trace.span("reload", cat="memory"):
            self.engine.resume_memory()

    def load_tensors(self, named: list[tuple[str, Any]], *, version: int,
                     bucket_bytes: int, block: tuple[int, int] | None = None,
                     lora_config: dict[str, Any] | None = None) -> float:
        """Copy the trainer's tensors into the engine (cast to its dtype); returns the seconds.
        One update for all of them: nothing crosses a process, so there are no buckets."""
        t0 = time.perf_counter()
        self.check_alive()
        with trace.span("weight_load", cat="weights", version=version):
            self.engine.load_tensors(named, weight_version=str(version), block=block,
                                     lora_config=lora_config)
        return time.perf_counter() - t0
