"""Weight routes: /update_weights_from_disk, /update_weight_version, /pull_weights. All admin.

Confinement (rltool.engine.security): model_path and source_dir must resolve under the allowed
weight roots; /pull_weights writes only into --local-checkpoint-dir (or a directory under it),
and never into a directory that holds its own source.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse

from rltool.engine import api
from rltool.engine.routes.base import EngineState, parse_body
from rltool.engine.security import ADMIN, confine, confine_local
from rltool.errors import BadInputError


def router(state: EngineState) -> APIRouter:
    r = APIRouter()
    link, cfg = state.link, state.cfg
    weight_roots = cfg.weight_roots()

    def refused(result: type, message: str) -> JSONResponse:
        return JSONResponse(result(success=False, message=message).model_dump(exclude_none=True),
                            status_code=400)

    @r.post(api.UPDATE_WEIGHTS_FROM_DISK, dependencies=[ADMIN])
    async def update_weights_from_disk(request: HttpRequest) -> JSONResponse:
        body = await parse_body(request, api.UpdateWeightsFromDiskInput)
        try:
            path = confine(body.model_path, weight_roots, what="model_path")
        except BadInputError as e:
            return refused(api.UpdateWeightsResult, str(e))

        status, answer = await link.call("update_weights_from_disk", model_path=str(path),
                                         abort_all=body.abort_all_requests,
                                         weight_version=body.weight_version)
        return JSONResponse(answer, status_code=status)

    @r.post(api.UPDATE_WEIGHT_VERSION, dependencies=[ADMIN])
    async def update_weight_version(request: HttpRequest) -> JSONResponse:
        body = await parse_body(request, api.UpdateWeightVersionInput)
        await link.call("set_weight_version", version=body.new_version,
                        abort_all=body.abort_all_requests)
        return JSONResponse(api.UpdateWeightVersionResult(
            success=True, message="Weight version updated.",
            new_version=body.new_version).model_dump())

    @r.post(api.PULL_WEIGHTS, dependencies=[ADMIN])
    async def pull_weights(request: HttpRequest) -> JSONResponse:
        body = await parse_body(request, api.PullWeightsInput)
        try:
            local = confine_local(body.local_checkpoint_dir, cfg.local_checkpoint_dir)
            source = confine(body.source_dir, weight_roots, what="source_dir")
            if source == local or local in source.parents:
                raise BadInputError(f"source_dir {body.source_dir} lies inside local_checkpoint_dir "
                                    f"{body.local_checkpoint_dir}, which a pull rewrites; publish "
                                    "versions outside --local-checkpoint-dir")
            result = await asyncio.to_thread(_pull, local=local, source=source,
                                             target_version=body.target_version,
                                             base_model_path=cfg.model)
        except (BadInputError, OSError) as e:
            return refused(api.PullWeightsResult, str(e))
        return JSONResponse(api.PullWeightsResult(success=True, message="Success.",
                                                  pull=result).model_dump())

    return r


def _pull(*, local: Path, source: Path, target_version: int, base_model_path: Any) -> dict:
    """slime's /pull_weights: sync files only (the caller then sends /update_weights_from_disk).
    Version 0 is the engine's own --model when the source has no weight_v000000."""
    from rltool.delta.pull import pull_weights

    return pull_weights(local_checkpoint_dir=local, source_dir=source,
                        target_version=target_version, base_model_path=base_model_path)
