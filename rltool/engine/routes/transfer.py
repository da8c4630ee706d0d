"""In-memory weight routes (SGLang's names and bodies), all admin:

- /update_weights_from_tensor: named tensors in a shared-memory segment on this host
  (load_format "rltool_shm") or in a sender's device buffer on the same GPU, as a CUDA IPC handle
  (load_format "rltool_cuda_ipc", CUDA engines), described by a JSON `TensorMessage`
  (rltool.delta.tensor_sync). A segment is checked (a regular file of the engine's user, no
  link, no FIFO) and copied off the scheduler thread; a CUDA IPC handle's reference counter and
  storage range are checked before a byte is read (rltool.delta.cuda_ipc).
- /init_weights_update_group, /update_weights_from_distributed: the engine joins a process group
  (gloo, or nccl on a CUDA engine: received straight into device buffers) and receives tensors
  that the trainer's rank 0 broadcasts. A join is refused past MAX_SYNC_WORLD_SIZE ranks (400)
  or at a host outside --allowed-sync-hosts (403), and answered 504 past its timeout_s.

Each update is applied by the scheduler like /update_weights_from_disk (after earlier requests
finish, or at once while paused, aborting first on abort_all_requests) and all-or-nothing: a wrong
name, shape or dtype answers 400 and the weights served before stay.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import torch
from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from rltool.delta import shm_read, sync_group, tensor_sync
from rltool.engine import api
from rltool.engine.routes.base import (EngineState, apply_weight_update, describe_errors,
                                       parse_body, refused_update)
from rltool.engine.security import ADMIN
from rltool.errors import BadInputError

# Beyond a request's timeout_s, how long the engine waits for torch to give up on its own.
JOIN_GRACE_S = 10.0


def router(state: EngineState) -> APIRouter:
    r = APIRouter()
    runner = state.runner
    groups: dict[str, Any] = {}
    joining: set[str] = set()
    shm_reads = asyncio.Lock()

    refused = refused_update

    async def apply(load: Any, *, abort_all: bool, weight_version: str | None) -> JSONResponse:
        return await apply_weight_update(state, load, abort_all=abort_all,
                                         weight_version=weight_version)

    @r.post(api.UPDATE_WEIGHTS_FROM_TENSOR, dependencies=[ADMIN])
    async def update_weights_from_tensor(request: HttpRequest) -> JSONResponse:
        body = await parse_body(request, api.UpdateWeightsFromTensorInput)
        if body.load_format not in api.TENSOR_FORMATS:
            return refused(f"load_format {body.load_format!r} is not served: the builtin engine "
                           f"loads no pickles; send load_format {api.SHM_FORMAT!r} or "
                           f"{api.CUDA_IPC_FORMAT!r} messages")
        if len(body.serialized_named_tensors) != 1:
            return refused(f"{len(body.serialized_named_tensors)} messages for 1 rank; send one")
        try:
            message = api.TensorMessage.model_validate(json.loads(body.serialized_named_tensors[0]))
        except ValueError as e:
            detail = describe_errors(e.errors()) if isinstance(e, ValidationError) else str(e)
            return refused(f"serialized_named_tensors[0] is not a tensor message: {detail}")
        if (message.transport == "cuda_ipc") != (body.load_format == api.CUDA_IPC_FORMAT):
            return refused(f"load_format {body.load_format!r} does not match the message's "
                           f"transport {message.transport!r}")
        device = runner.device
        if message.transport == "cuda_ipc":
            def load() -> None:
                with tensor_sync.open_message(message, device=device) as named:
                    runner.load_named_tensors(named, block=message.weight_block_size,
                                              lora_config=body.lora_config)

            return await apply(load, abort_all=body.abort_all_requests,
                               weight_version=body.weight_version)
        # The segment is checked and copied off the scheduler thread, one update at a time (one
        # bucket of extra memory); the scheduler only copies the private buffer in.
        async with shm_reads:
            try:
                buf = await asyncio.to_thread(shm_read.read_segment, message.segment,
                                              message.nbytes)
            except BadInputError as e:
                return refused(str(e))

            def load_copy() -> None:
                runner.load_named_tensors(tensor_sync.unpack(buf, message),
                                          block=message.weight_block_size,
                                          lora_config=body.lora_config)

            return await apply(load_copy, abort_all=body.abort_all_requests,
                               weight_version=body.weight_version)

    @r.post(api.INIT_WEIGHTS_UPDATE_GROUP, dependencies=[ADMIN])
    async def init_weights_update_group(request: HttpRequest) -> JSONResponse:
        body = await parse_body(request, api.InitWeightsUpdateGroupInput)
        if body.group_name in groups or body.group_name in joining:
            return refused(f"group {body.group_name!r} exists; choose another group_name")
        joining.add(body.group_name)
        try:
            # torch bounds the join by timeout_s; the wait is bounded too, should a step of it
            # not honour that (the thread then ends on its own, its group unused).
            group = await asyncio.wait_for(asyncio.to_thread(
                sync_group.join_group, master_address=body.master_address,
                master_port=body.master_port, rank=body.rank_offset,
                world_size=body.world_size, backend=body.backend, timeout_s=body.timeout_s,
                allowed_hosts=state.cfg.allowed_sync_hosts), body.timeout_s + JOIN_GRACE_S)
            # nccl receives on the engine's device, gloo through host memory
            groups[body.group_name] = (group, runner.device if body.backend == "nccl" else "cpu")
        except sync_group.SyncHostRefusedError as e:
            return refused(str(e), status_code=403)
        except sync_group.SyncTimeoutError as e:
            return refused(str(e), status_code=504)
        except TimeoutError:
            return refused(f"joining the weight update group at {body.master_address}:"
                           f"{body.master_port} took longer than timeout_s {body.timeout_s:g}; "
                           "check that the master and every rank are up", status_code=504)
        except BadInputError as e:
            return refused(str(e))
        finally:
            joining.discard(body.group_name)
        return JSONResponse(api.UpdateWeightsResult(
            success=True, message="Succeeded to initialize custom process group.").model_dump())

    @r.post(api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, dependencies=[ADMIN])
    async def update_weights_from_distributed(request: HttpRequest) -> JSONResponse:
        body = await parse_body(request, api.UpdateWeightsFromDistributedInput)
        if body.group_name not in groups:
            return refused(f"no group {body.group_name!r}; call /init_weights_update_group first")
        group, device = groups[body.group_name]
        try:
            buffers = _receive_buffers(body, limit_bytes=_param_bytes(runner), device=device)
        except BadInputError as e:
            return refused(str(e))
        # Received off the scheduler thread (generation goes on), applied by the scheduler.
        await asyncio.to_thread(tensor_sync.broadcast, group, buffers)
        named = list(zip(body.names, buffers))
        return await apply(lambda: runner.load_named_tensors(named, lora_config=body.lora_config),
                           abort_all=body.abort_all_requests, weight_version=body.weight_version)

    return r


def _param_bytes(runner: Any) -> int:
    if runner.model is None:
        raise BadInputError("weights are released; call /resume_memory_occupation first")
    model = runner.model
    if hasattr(model, "nbytes"):  # the paged runner's fused model
        return int(model.nbytes())
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _receive_buffers(body: api.UpdateWeightsFromDistributedInput, *, limit_bytes: int,
                     device: Any) -> list[torch.Tensor]:
    """Buffers for the broadcast, in the declared dtypes and shapes. The tensors are received even
    when their names or shapes will then be refused, so the sender's collective always completes;
    only a malformed body (which the sender itself got wrong) is refused before receiving."""
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
