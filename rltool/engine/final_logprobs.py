"""Logprobs filled in when a request finishes: in deterministic mode the output's, recomputed by
one unpadded pass over prompt + response (the trainer's layout), and the prompt's input logprobs
(`logprob_start_len`), both from the runner's `full_pass_logits`.
"""

from __future__ import annotations

from typing import Any

import torch

from rltool.engine.request import Request
from rltool.errors import EngineError
from rltool.logprobs import effective_temperature, logits_to_logprobs


def recompute_logprobs(runner: Any, req: Request, *, deterministic: bool) -> None:
    """Set the finished request's recomputed output logprobs (deterministic mode) and its input
    logprobs (when asked for); nothing when it did not ask for logprobs."""
    if not req.return_logprob:
        return
    temp = req.params.temperature
    ids = req.all_ids()
    wants_input = req.logprob_start_len >= 0
    recompute = deterministic and req.output_ids
    if not (recompute or wants_input):
        return
    if runner.released:
        raise EngineError("the weights are released (/release_memory_occupation); resume "
                          "them before asking for recomputed logprobs")
    start = max(req.logprob_start_len, 0) if wants_input else len(req.prompt_ids)
    first = max(start, 1)
    logits = runner.full_pass_logits(ids, start=first)
    targets = torch.tensor(ids[first:], device=logits.device)
    chosen = logits_to_logprobs(logits, targets, temperature=temp).tolist()
    n_prompt = len(req.prompt_ids)
    out_from = n_prompt - first
    if recompute:
        req.output_logprobs = chosen[out_from:]
        rows = torch.log_softmax(logits[out_from:].float() / effective_temperature(temp), dim=-1)
        if req.top_logprobs_num > 0:
            values, idx = rows.topk(req.top_logprobs_num, dim=-1)
            req.output_top_logprobs = [list(zip(v, i)) for v, i in
                                       zip(values.tolist(), idx.tolist())]
        if req.token_ids_logprob:
            req.output_token_ids_logprobs = [[(float(row[t]), t) for t in req.token_ids_logprob]
                                             for row in rows]
    if wants_input:
        # SGLang's shape: one entry per prompt position from `start`, the first one null.
        skip = 0 if start == 0 else 1
        req.input_logprobs = [None] + chosen[skip:out_from]
        if req.top_logprobs_num > 0:
            rows = torch.log_softmax(logits[skip:out_from].float() / effective_temperature(temp),
                                     dim=-1)
            values, idx = rows.topk(req.top_logprobs_num, dim=-1)
            req.input_top_logprobs = [None] + [list(zip(v, i)) for v, i in
                                               zip(values.tolist(), idx.tolist())]
