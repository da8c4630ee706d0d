"""Health, readiness, load and information routes (read-only; /health* and /ready need no key)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from rltool.engine import api
from rltool.engine.routes.base import EngineState
from rltool.errors import EngineError

HEALTH_GENERATE_TIMEOUT_S = 20.0


def router(state: EngineState) -> APIRouter:
    r = APIRouter()
    sched, runner, cfg = state.scheduler, state.runner, state.cfg

    @r.get(api.HEALTH)
    async def health() -> Response:
        # Deliberately unlike SGLang: 200 while the engine lives, even paused or released, so a
        # supervisor does not restart an engine the trainer paused on purpose.
        return Response(status_code=200 if sched.alive else 503)

    @r.get(api.READY)
    async def ready() -> Response:
        serving = sched.alive and sched.paused is None and not runner.released
        return Response(status_code=200 if serving else 503)

    @r.get(api.LOADS)
    async def loads() -> dict[str, Any]:
        """smg's load polling (least_load / power_of_two policies)."""
        st = sched.stats()
        return {"loads": [{"dp_rank": 0, "num_running_reqs": st["num_running_reqs"],
                           "num_waiting_reqs": st["num_waiting_reqs"],
                           "token_usage": st["num_running_reqs"] / cfg.max_running_requests,
                           "gen_throughput": st["gen_throughput"]}]}

    @r.get(api.HEALTH_GENERATE)
    async def health_generate() -> Response:
        body = api.GenerateInput(input_ids=[0], sampling_params={"max_new_tokens": 1,
                                                                 "temperature": 0.0})
        reqs, _ = state.expand(body)
        try:
            await asyncio.wait_for(state.run(reqs), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineError):
            return Response(status_code=503)
        return Response(status_code=200)

    @r.get(api.MODEL_INFO)
    @r.get(api.MODEL_INFO_ALIAS)
    async def model_info() -> dict[str, Any]:
        return state.model_info()

    @r.get(api.SERVER_INFO)
    @r.get(api.SERVER_INFO_ALIAS)
    async def server_info() -> dict[str, Any]:
        info = cfg.model_dump(mode="json", exclude={"api_key", "admin_api_key"})
        info.update({
            "model_path": str(runner.model_path),
            "served_model_name": state.served_model_name,
            "tp_size": 1, "dp_size": 1,
            "context_length": runner.context_length,
            "max_total_num_tokens": runner.max_total_num_tokens,  # the KV pool, as SGLang
            "max_req_input_len": runner.context_length - 1,
            "weight_version": runner.weight_version, **runner.weight_info,
            "kv_bytes_per_token": runner.kv_bytes_per_token,
            "kv_pool_tokens": runner.max_total_num_tokens,
            # B_cache = N*c_A + K*c_R (K = 0 for a model without recurrent state)
            "cache_sizes": runner.cache_sizes(),
            "hicache": runner.cache_stats(),  # prefix-cache hits per tier, host tier traffic
            # --enable-lora: the policy adapter (once a sync installed one), then the named ones
            "lora_adapters": runner.lora.describe() if runner.lora is not None else [],
            "internal_states": [sched.stats()],
            "version": _version(),
            "engine": "builtin",
            "uptime_s": time.monotonic() - state.started,
        })
        return info

    @r.get(api.WEIGHT_VERSION)
    @r.get(api.WEIGHT_VERSION_ALIAS)
    async def weight_version() -> dict[str, Any]:
        return api.WeightVersionInfo(weight_version=runner.weight_version).model_dump()

    return r


def _version() -> str:
    from rltool import __version__

    return __version__
