"""The weight updates the engine's routes ask for, run where the model lives (rltool.engine.ops):
from disk, from a tensor message (shared memory or CUDA IPC) and from a process group.

Each answers (HTTP status, SGLang's `{"success", "message", ...}` body). An update is applied by
the scheduler between steps, after the requests that arrived before it finish (or at once while
paused; aborting first on abort_all_requests), and all or nothing: a wrong name, shape or dtype
answers 400 and the weights served before stay. A shared-memory segment is checked and copied
off the scheduler thread, one update at a time (one bucket of extra memory); the scheduler only
copies the private buffer in. Tensors of a process group are received off the scheduler thread
too (generation goes on) and applied like the others.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from rltool import trace
from rltool.engine import api
from rltool.errors import BadInputError, EngineError

# Beyond a request's timeout_s, how long the engine waits for torch to give up on its own.
JOIN_GRACE_S = 10.0

Answer = tuple[int, dict[str, Any]]


def refused(message: str, status_code: int = 400) -> Answer:
    """A weight update refused: `{"success": false, "message"}`, 400 unless told otherwise (403
    for a host it may not join, 504 past a join's timeout, 503 while the engine stops)."""
    return status_code, api.UpdateWeightsResult(success=False,
                                                 message=message).model_dump(exclude_none=True)


class WeightOps:
    """Weight updates of one engine (its runner and scheduler)."""

    def __init__(self, *, runner: Any, scheduler: Any, allowed_sync_hosts: list[str]):
        self.runner = runner
        self.sched = scheduler
        self.allowed_sync_hosts = allowed_sync_hosts
        self.groups: dict[str, Any] = {}
        self.joining: set[str] = set()
        self.shm_reads = asyncio.Lock()

    async def apply(self, load: Callable[[], Any], *, abort_all: bool,
                    weight_version: str | None) -> Answer:
        """Run `load` (which changes the weights, all or nothing) when the scheduler allows it,
        then set the version."""
        sched, runner = self.sched, self.runner

        def run() -> int:
            paused = len(sched.running) + len(sched.prefilling) if sched.paused else 0
            with trace.span("weight_load", cat="weights"):
                load()
            if weight_version is not None:
                runner.weight_version = weight_version
            return paused

        try:
            paused = await self.on_update(run, abort_all=abort_all)
        except (BadInputError, EngineError) as e:
            return refused(str(e), 400 if sched.alive else 503)  # 503: the engine is stopping
        message = "Succeeded to update model weights."
        if weight_version is not None:
            message += f" Weight version updated to {weight_version}."
        return 200, api.UpdateWeightsResult(success=True, message=message,
                                            num_paused_requests=paused).model_dump()

    async def on_update(self, apply: Callable[[], Any], *, abort_all: bool) -> Any:
        """Run `apply` as the scheduler's weight update (`PagedScheduler.update_weights`) and
        await its result."""
        return await asyncio.wrap_future(self.sched.update_weights(apply, abort_all=abort_all))

    async def update_weights_from_disk(self, *, model_path: str, abort_all: bool,
                                       weight_version: str | None) -> Answer:
        """`model_path` is confined to the weight roots by the caller."""
        from pathlib import Path

        runner = self.runner
        return await self.apply(lambda: runner.load_weights(Path(model_path)),
                                abort_all=abort_all, weight_version=weight_version)

    async def update_weights_from_tensor(self, *, body: dict[str, Any]) -> Answer:
        from rltool.delta import shm_read, tensor_sync
        from rltool.engine.routes.base import describe_errors

        b = api.UpdateWeightsFromTensorInput.model_validate(body)
        runner = self.runner
        if b.load_format not in api.TENSOR_FORMATS:
            return refused(f"load_format {b.load_format!r} is not served: the builtin engine "
                           f"loads no pickles; send load_format {api.SHM_FORMAT!r} or "
                           f"{api.CUDA_IPC_FORMAT!r} messages")
        if len(b.serialized_named_tensors) != 1:
            return refused(f"{len(b.serialized_named_tensors)} messages for 1 rank; send one")
        try:  # pydantic's JSON parser bounds nesting (json.loads recursed until it failed)
            message = api.TensorMessage.model_validate_json(b.serialized_named_tensors[0])
        except ValidationError as e:
            return refused("serialized_named_tensors[0] is not a tensor message: "
                           f"{describe_errors(e.errors())}")
        if (message.transport == "cuda_ipc") != (b.load_format == api.CUDA_IPC_FORMAT):
            return refused(f"load_format {b.load_format!r} does not match the message's "
                           f"transport {message.transport!r}")
        if message.transport == "cuda_ipc":
            def load() -> None:
                with tensor_sync.open_message(message, device=runner.device) as named:
                    runner.load_named_tensors(named, block=message.weight_block_size,
                                              lora_config=b.lora_config)

            return await self.apply(load, abort_all=b.abort_all_requests,
                                    weight_version=b.weight_version)
        async with self.shm_reads:
            try:
                buf = await asyncio.to_thread(shm_read.read_segment, message.segment,
                                              message.nbytes)
            except BadInputError as e:
                return refused(str(e))

            def load_copy() -> None:
                runner.load_named_tensors(tensor_sync.unpack(buf, message),
                                          block=message.weight_block_size,
                                          lora_config=b.lora_config)

            return await self.apply(load_copy, abort_all=b.abort_all_requests,
                                    weight_version=b.weight_version)

    async def init_weights_update_group(self, *, body: dict[str, Any]) -> Answer:
        from rltool.delta import sync_group

        b = api.InitWeightsUpdateGroupInput.model_validate(body)
        if b.group_name in self.groups or b.group_name in self.joining:
            return refused(f"group {b.group_name!r} exists; choose another group_name")
        self.joining.add(b.group_name)
        try:
            # torch bounds the join by timeout_s; the wait is bounded too, should a step of it
            # not honour that (the thread then ends on its own, its group unused).
            group = await asyncio.wait_for(asyncio.to_thread(
                sync_group.join_group, master_address=b.master_address,
                master_port=b.master_port, rank=b.rank_offset, world_size=b.world_size,
                backend=b.backend, timeout_s=b.timeout_s,
                allowed_hosts=self.allowed_sync_hosts), b.timeout_s + JOIN_GRACE_S)
            # nccl receives on the engine's device, gloo through host memory
            self.groups[b.group_name] = (group,
                                         self.runner.device if b.backend == "nccl" else "cpu")
        except sync_group.SyncHostRefusedError as e:
            return refused(str(e), status_code=403)
        except sync_group.SyncTimeoutError as e:
            return refused(str(e), status_code=504)
        except TimeoutError:
            return refused(f"joining the weight update group at {b.master_address}:"
                           f"{b.master_port} took longer than timeout_s {b.timeout_s:g}; "
                           "check that the master and every rank are up", status_code=504)
        except BadInputError as e:
            return refused(str(e))
        finally:
            self.joining.discard(b.group_name)
        return 200, api.UpdateWeightsResult(
            success=True, message="Succeeded to initialize custom process group.").model_dump()

    async def update_weights_from_distributed(self, *, body: dict[str, Any]) -> Answer:
        from rltool.delta import tensor_sync

        b = api.UpdateWeightsFromDistributedInput.model_validate(body)
        if b.group_name not in self.groups:
            return refused(f"no group {b.group_name!r}; call /init_weights_update_group first")
        group, device = self.groups[b.group_name]
        try:
            buffers = _receive_buffers(b, limit_bytes=_param_bytes(self.runner), device=device)
        except BadInputError as e:
            return refused(str(e))
        await asyncio.to_thread(tensor_sync.broadcast, group, buffers)
        named = list(zip(b.names, buffers))
        runner = self.runner
        return await self.apply(lambda: runner.load_named_tensors(named,
                                                                  lora_config=b.lora_config),
                                abort_all=b.abort_all_requests, weight_version=b.weight_version)


def _param_bytes(runner: Any) -> int:
    if runner.model is None:
        raise BadInputError("weights are released; call /resume_memory_occupation first")
    model = runner.model
    if hasattr(model, "nbytes"):  # the paged runner's fused model
        return int(model.nbytes())
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _receive_buffers(body: api.UpdateWeightsFromDistributedInput, *, limit_bytes: int,
                     device: Any) -> list[Any]:
    """Buffers for the broadcast, in the declared dtypes and shapes. The tensors are received even
    when their names or shapes will then be refused, so the sender's collective always completes;
    only a malformed body (which the sender itself got wrong) is refused before receiving."""
    import torch

    from rltool.delta import tensor_sync

    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        raise BadInputError(f"names, dtypes and shapes differ in length ({len(body.names)}, "
                            f"{len(body.dtypes)}, {len(body.shapes)})")
    buffers: list[tuple[list[int], torch.dtype]] = []
    total = 0
    for name, dtype, shape in zip(body.names, body.dtypes, body.shapes):
        if any(d < 0 for d in shape):
            raise BadInputError(f"tensor {name!r}: negative dimension in {shape}")
        torch_dtype = tensor_sync.dtype_of(dtype)
        total += math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
        if total > limit_bytes:
            raise BadInputError(f"the update declares more bytes than the served model holds "
                                f"({limit_bytes}); split it or fix the shapes")
        buffers.append((shape, torch_dtype))
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in buffers]
