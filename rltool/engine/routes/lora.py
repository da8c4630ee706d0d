"""LoRA adapter routes (--enable-lora): /load_lora_adapter and /unload_lora_adapter, SGLang's
bodies and answers. Both admin.

lora_path is confined to the weight roots as /update_weights_from_disk's model_path is (403
outside them). An adapter that a waiting or running request names is not unloaded: 409, the
client retries once those requests have finished. The policy adapter is a weight sync's
(/update_weights_from_disk, /update_weights_from_tensor), never these routes'.
"""

from __future__ import annotations

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse

from rltool.engine import api
from rltool.engine.routes.base import EngineState, parse_body
from rltool.engine.security import ADMIN, confine
from rltool.errors import BadInputError


def router(state: EngineState) -> APIRouter:
    r = APIRouter()
    link, enabled = state.link, state.info.lora_enabled
    weight_roots = state.cfg.weight_roots()

    async def answer(status: int, error: str = "") -> JSONResponse:
        loaded = await link.call("lora_adapters")
        return JSONResponse(api.LoraAdapterResult(success=not error, error_message=error,
                                                  loaded_adapters=loaded).model_dump(),
                            status_code=status)

    async def lora_off() -> JSONResponse:
        return await answer(400, "LoRA adapters need an engine started with --enable-lora")

    @r.post(api.LOAD_LORA_ADAPTER, dependencies=[ADMIN])
    async def load_lora_adapter(request: HttpRequest) -> JSONResponse:
        body = await parse_body(request, api.LoadLoraAdapterInput)
        if not enabled:
            return await lora_off()
        try:
            path = confine(body.lora_path, weight_roots, what="lora_path")
        except BadInputError as e:
            return await answer(403, str(e))
        try:
            await link.call("load_lora", name=body.lora_name, path=str(path))
        except BadInputError as e:
            return await answer(400, str(e))
        return await answer(200)

    @r.post(api.UNLOAD_LORA_ADAPTER, dependencies=[ADMIN])
    async def unload_lora_adapter(request: HttpRequest) -> JSONResponse:
        body = await parse_body(request, api.UnloadLoraAdapterInput)
        if not enabled:
            return await lora_off()
        name = body.lora_name
        try:
            users = await link.call("unload_lora", name=name)
        except BadInputError as e:
            return await answer(400, str(e))
        if users:
            return await answer(409, f"adapter {name!r} is in use by {users} waiting or running "
                               "requests; unload it once they have finished")
        return await answer(200)

    return r
