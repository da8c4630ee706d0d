"""Debug routes of the builtin engine, mounted only with `rltool serve --enable-debug-endpoints`.

`POST /debug/hidden_states {"input_ids": [...]}` runs one unpadded forward over the token ids with
the weights the engine serves right now (on the scheduler thread, between steps) and answers

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
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.routes.base import EngineState, parse_body
from rltool.engine.security import ADMIN
from rltool.errors import BadInputError


def hidden_states(runner: PagedRunner, input_ids: list[int]) -> dict[str, Any]:
    """Per-layer hidden states and token logprobs of one unpadded pass (scheduler thread)."""
    import torch

    from rltool.logprobs import logits_to_logprobs

    if runner.released:
        raise BadInputError("weights are released; call /resume_memory_occupation first")
    bad = [t for t in input_ids if not 0 <= t < runner.vocab_size]
    if bad:
        raise BadInputError(f"input_ids: token id {bad[0]} outside [0, {runner.vocab_size})")
    if len(input_ids) > runner.context_length:
        raise BadInputError(f"input_ids: {len(input_ids)} tokens exceed the context length "
                            f"{runner.context_length}")
    states, logits = runner.hidden_states(input_ids)
    ids = torch.tensor(input_ids, dtype=torch.long)
    logprobs = logits_to_logprobs(logits[:-1].cpu(), ids[1:], temperature=1.0)
    return {"weight_version": runner.weight_version, "dtype": runner.dtype,
            "num_tokens": len(input_ids),
            "hidden_states": [h.double().tolist() for h in states],
            "token_logprobs": logprobs.double().tolist()}


def router(state: EngineState) -> APIRouter:
    r = APIRouter()

    @r.post(api.DEBUG_HIDDEN_STATES, dependencies=[ADMIN])
    async def debug_hidden_states(request: HttpRequest) -> dict[str, Any]:
        body = await parse_body(request, api.HiddenStatesInput)
        return await state.on_thread(lambda: hidden_states(state.runner, body.input_ids))

    return r
