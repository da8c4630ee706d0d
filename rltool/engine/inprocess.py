"""The builtin engine run inside the caller's process: no server, no HTTP, no JSON.

`InProcessEngine(cfg)` builds the same runner and scheduler as `rltool serve` (server.build_engine)
and starts the scheduler thread. It answers the calls the rollout stage makes of an engine client
(`generate`, `health`, `abort_request`, `get_model_info`, `aclose`, as
rltool.rollout.client.EngineClient does) with the bodies the HTTP routes would return, built by the
routes' own `EngineState`; and it takes weights straight from the caller's tensors (`load_tensors`),
applied by the scheduler between steps like /update_weights_from_tensor.

It releases and resumes its memory like /release_memory_occupation and /resume_memory_occupation
(`release_memory`, `resume_memory`: weights, KV pool and CUDA graphs; requests in flight are
retracted and re-prefilled later). What it does not do: serve anyone else (no URL, no admin key, no
OpenAI routes), stream, or load weights from disk after start.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from rltool.config import torch_dtype_name
from rltool.delta.tensor_sync import dtype_of
from rltool.engine.api import GenerateInput
from rltool.engine.config import ServeConfig
from rltool.engine.routes.base import EngineState, describe_errors, failure
from rltool.engine.scheduler import QueueFullError
from rltool.engine.server import build_engine
from rltool.errors import BadInputError, EngineError

URL_SCHEME = "inprocess://"


class InProcessEngine:
    """One builtin engine on a scheduler thread of this process; `url` only names it."""

    def __init__(self, cfg: ServeConfig, *, name: str = "engine-0"):
        runner, scheduler = build_engine(cfg)
        self.url = f"{URL_SCHEME}{name}"
        self.state = EngineState(cfg=cfg, runner=runner, scheduler=scheduler,
                                 started=time.monotonic())
        scheduler.start()

    @property
    def runner(self) -> Any:
        return self.state.runner

    @property
    def scheduler(self) -> Any:
        return self.state.scheduler

    def stop(self) -> None:
        """Stop the scheduler thread and free the weights, KV pool and graphs: a caller that
        goes on (a loop run as a library, the next test) gets the device memory back."""
        self.scheduler.stop()
        self.runner.release()

    # ----- what a rollout client calls -------------------------------------------------------

    async def generate(self, payload: dict[str, Any], *,
                       routing_key: str | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """/generate's answer for a payload (a list for a batch or n > 1). The errors the route
        answers with a status are raised as EngineError with that status."""
        try:
            body = GenerateInput.model_validate(payload)
        except ValidationError as e:
            raise EngineError(f"{self.url}: bad generate body: {describe_errors(e.errors())}",
                              status_code=400) from e
        with self._refusals():
            reqs, as_list = self.state.expand(body)
            outs = await self.state.run(reqs)
        failed = failure(*outs)
        if failed is not None:
            message, status = failed
            raise EngineError(f"{self.url}: {message}", status_code=status)
        return outs if as_list else outs[0]

    async def health(self) -> None:
        if not self.scheduler.alive:
            raise EngineError(f"{self.url}: the scheduler thread has stopped")

    async def abort_request(self, *, rid: str = "", abort_all: bool = False) -> None:
        with self._refusals():
            await self.state.link.call("abort", rid=rid, abort_all=abort_all)

    async def get_model_info(self) -> dict[str, Any]:
        return await self.state.model_info()

    async def aclose(self) -> None:
        """A client's close: the engine outlives the rollout stages that use it (see stop)."""

    # ----- memory and weights ----------------------------------------------------------------

    def release_memory(self) -> None:
        """Free weights, KV pool and graphs between scheduler steps (requests are retracted)."""
        runner, scheduler = self.runner, self.scheduler

        def release() -> None:
            scheduler.retract_for_release()
            runner.release()

        with self._refusals():
            scheduler.call(release).result()

    def resume_memory(self) -> None:
        """Rebuild what release_memory freed (the weights of the checkpoint loaded at start: a
        weight update follows)."""
        with self._refusals():
            self.scheduler.call(self.runner.resume).result()

    def load_tensors(self, named: list[tuple[str, Any]], *, weight_version: str,
                     block: tuple[int, int] | None = None,
                     lora_config: dict[str, Any] | None = None) -> None:
        """Copy named tensors into the served model (cast to the engine's --dtype), after the requests that
        arrived before have finished; all or nothing (a wrong name or shape raises EngineError
        with status 400 and the weights stay; a stopping engine, status 503)."""
        runner = self.runner
        dtype = dtype_of(torch_dtype_name(self.state.cfg.dtype))

        def apply() -> None:
            runner.load_named_tensors(named if block is not None else  # block FP8: as sent
                                      [(n, t.detach().to(dtype) if t.is_floating_point() else t)
                                       for n, t in named], block=block,  # INT4 codes as sent
                                      lora_config=lora_config)
            runner.weight_version = weight_version

        with self._refusals("weight update refused: "):
            self.scheduler.update_weights(apply, abort_all=False).result()

    @contextlib.contextmanager
    def _refusals(self, what: str = "") -> Iterator[None]:
        """Raise the engine's refusals as EngineError with the status the routes answer: 429 a
        full queue, 400 bad input, 503 any other EngineError (the engine shutting down)."""
        try:
            yield
        except QueueFullError as e:
            raise EngineError(f"{self.url}: {what}{e}", status_code=429) from e
        except BadInputError as e:
            raise EngineError(f"{self.url}: {what}{e}", status_code=400) from e
        except EngineError as e:
            raise EngineError(f"{self.url}: {what}{e}", status_code=503) from e
