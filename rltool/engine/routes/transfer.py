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

The routes parse the bodies; the work (reading the segment, opening the handle, joining and
receiving) happens where the model lives (rltool.engine.weight_ops, through the state's link).
Each update is applied by the scheduler like /update_weights_from_disk (after earlier requests
finish, or at once while paused, aborting first on abort_all_requests) and all-or-nothing: a wrong
name, shape or dtype answers 400 and the weights served before stay.
"""

from __future__ import annotations

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse

from rltool.engine import api
from rltool.engine.routes.base import EngineState, parse_body
from rltool.engine.security import ADMIN


def router(state: EngineState) -> APIRouter:
    r = APIRouter()
    link = state.link

    async def forward(request: HttpRequest, model: type, op: str) -> JSONResponse:
        body = await parse_body(request, model)
        status, answer = await link.call(op, body=body.model_dump(mode="json"))
        return JSONResponse(answer, status_code=status)

    @r.post(api.UPDATE_WEIGHTS_FROM_TENSOR, dependencies=[ADMIN])
    async def update_weights_from_tensor(request: HttpRequest) -> JSONResponse:
        return await forward(request, api.UpdateWeightsFromTensorInput,
                             "update_weights_from_tensor")

    @r.post(api.INIT_WEIGHTS_UPDATE_GROUP, dependencies=[ADMIN])
    async def init_weights_update_group(request: HttpRequest) -> JSONResponse:
        return await forward(request, api.InitWeightsUpdateGroupInput,
                             "init_weights_update_group")

    @r.post(api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, dependencies=[ADMIN])
    async def update_weights_from_distributed(request: HttpRequest) -> JSONResponse:
        return await forward(request, api.UpdateWeightsFromDistributedInput,
                             "update_weights_from_distributed")

    return r
