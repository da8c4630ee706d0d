"""One generation request as the scheduler tracks it, and its SGLang-shaped response.

Token accounting: `output_ids` holds every sampled token (EOS and stop tokens included, as SGLang
counts them in completion_tokens). The KV cache of a request in flight holds prompt + output[:-1];
the last sampled token is fed at the next decode step. `spans` records which weight version
sampled which output tokens: [(version, start)], each span ending where the next one starts (the
last one at the end of the output); `weight_spans` gives SGLang's [{version, start, end}].
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rltool.engine.detokenize import StreamedText
from rltool.engine.sampling import SamplingParams
from rltool.engine.stop_rule import StopRule, StopText


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seq: int = 0  # arrival order, set by the scheduler
    lora: str | None = None  # --enable-lora: the adapter its lora_path names (None: the policy's)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    generator: torch.Generator | None = None
    # Called on the scheduler thread: after each sampled token (streaming) and once at the end.
    on_token: Callable[["Request"], None] | None = None
    on_finish: Callable[["Request"], None] | None = None

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    # int32 [tokens - 1, layers, k], set when a request with return_routed_experts finishes
    routed_experts: np.ndarray | None = None
    spans: list[tuple[str, int]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    text: str = ""
    matched_stop_at: int | None = None  # char offset of a matched stop string in the full text

    num_cached: int = 0  # tokens whose KV is in the cache
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    stop_rule: StopRule | None = None  # set by the request queue at admission
    stop_text: StopText | None = None  # likewise, for a request with stop strings or patterns
    # a streamed request's text so far (set at admission, kept while it is retracted)
    streamed: StreamedText | None = None
    # Set by the batch builder when it first samples the request, kept while it is retracted:
    # (temperature, greedy, base seed, plain, min new tokens).
    sampling_consts: tuple[float, bool, int, bool, int] | None = None

    t_arrival: float = field(default_factory=time.monotonic)
    t_first_token: float | None = None
    t_finish: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_target(self) -> int:
        """Tokens that must be in the cache before the next decode step (all but the pending one)."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def record_token(self, token: int, logprob: float, *, version: str,
                     top: list[tuple[float, int]] | None = None,
                     ids_lp: list[tuple[float, int]] | None = None) -> None:
        out = self.output_ids
        if not out:
            self.t_first_token = time.monotonic()
        out.append(token)
        self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)
        if ids_lp is not None:
            self.output_token_ids_logprobs.append(ids_lp)
        spans = self.spans
        if not spans or spans[-1][0] != version:
            spans.append((version, len(out) - 1))

    def weight_spans(self) -> list[dict[str, Any]]:
        """[{version, start, end}] over output token indices, `end` exclusive."""
        ends = [start for _, start in self.spans[1:]] + [len(self.output_ids)]
        return [{"version": v, "start": s, "end": e} for (v, s), e in zip(self.spans, ends)]

    def reset_cache(self) -> None:
        """Drop the KV cache (retract / memory release); it is recomputed from all_ids()."""
        self.num_cached = 0

    def failed_copy(self, error: Exception) -> Request:
        """A blank copy of this request, finished with HTTP 500 for `error` (a failure while
        handling it outside the scheduler): what it holds may be what failed."""
        return Request(rid=self.rid, prompt_ids=self.prompt_ids, params=self.params,
                       finish_reason={"type": "abort", "status_code": 500,
                                      "message": f"internal error: {type(error).__name__}: "
                                                 f"{error}"},
                       t_arrival=self.t_arrival, t_finish=time.monotonic())


def _triples(pairs: list[tuple[float | None, int]], tokenizer: Any, with_text: bool
             ) -> list[list[Any]]:
    return [[lp, tok, tokenizer.decode([tok]) if with_text else None] for lp, tok in pairs]


def build_response(req: Request, *, tokenizer: Any, weight_version: str) -> dict[str, Any]:
    """The /generate object for `req` (cumulative so far when not finished)."""
    n_out = len(req.output_ids)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": n_out,
        "cached_tokens": req.cached_tokens,
        "reasoning_tokens": 0,
        "weight_version": req.spans[-1][0] if req.spans else weight_version,
        "weight_versions": req.weight_spans(),
    }
    if req.finished and req.t_finish is not None:
        meta["e2e_latency"] = req.t_finish - req.t_arrival
    if req.finished and req.routed_experts is not None:
        meta["routed_experts"] = base64.b64encode(
            req.routed_experts.astype("<i4", copy=False).tobytes()).decode("ascii")
    if req.return_logprob:
        with_text = req.return_text_in_logprobs
        meta["output_token_logprobs"] = _triples(
            list(zip(req.output_logprobs[:n_out], req.output_ids)), tokenizer, with_text)
        meta["output_token_logprobs_length"] = n_out
        if req.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [_triples(top, tokenizer, with_text)
                                           for top in req.output_top_logprobs[:n_out]]
        if req.token_ids_logprob:
            meta["output_token_ids_logprobs"] = [_triples(x, tokenizer, with_text)
                                                 for x in req.output_token_ids_logprobs[:n_out]]
        if req.input_logprobs is not None:
            start = max(req.logprob_start_len, 0)
            meta["input_token_logprobs"] = _triples(
                list(zip(req.input_logprobs, req.prompt_ids[start:])), tokenizer, with_text)
            if req.input_top_logprobs is not None:
                meta["input_top_logprobs"] = [None if top is None else
                                              _triples(top, tokenizer, with_text)
                                              for top in req.input_top_logprobs]
    return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}
