"""Debug routes of the builtin engine, mounted only with `rltool serve --enable-debug-endpoints`.

`POST /debug/hidden_states {"input_ids": [...]}` runs one unpadded forward over the token ids with
the weights the engine serves right now (rltool.engine.ops.hidden_states, on the scheduler
thread, between steps) and answers

    {"weight_version": str, "dtype": "fp32"|"bf16", "num_tokens": T,
     "hidden_states": [[[float] * H] * T] * (L + 1),   # transformers' output_hidden_states
     "token_logprobs": [float] * (T - 1)}              # log p(ids[t] | ids[:t]) at temperature 1

`rltool align-gate --layerwise` compares these with the trainer model's (rltool.align.layerwise).
Values are the engine's tensors widened to float64 for JSON, so they round-trip exactly. Without
the flag the route does not exist (404), so production engines expose no activations; with it,
the route is an admin route (it reveals the weights' activations).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request as HttpRequest

from rltool.engine import api
from rltool.engine.routes.base import EngineState, parse_body
from rltool.engine.security import ADMIN


def router(state: EngineState) -> APIRouter:
    r = APIRouter()

    @r.post(api.DEBUG_HIDDEN_STATES, dependencies=[ADMIN])
    async def debug_hidden_states(request: HttpRequest) -> dict[str, Any]:
        body = await parse_body(request, api.HiddenStatesInput)
        return await state.link.call("hidden_states", input_ids=body.input_ids)

    return r
