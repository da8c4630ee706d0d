"""Validation and expansion of a /generate body into scheduler requests.

A batch (list of prompts) and/or `n > 1` expand prompt-major into one Request per sample, whose
response goes at the same position of the returned list; a body of more requests than the engine
ever holds (queued and running) is refused (400) before any is built. Fields SGLang accepts that
this engine cannot honour are refused (400), never silently ignored; `token_ids_logprob` is
de-duplicated (first occurrence kept) and holds at most the vocabulary's size of ids.
"""

from __future__ import annotations

import uuid
from typing import Any

from rltool.engine.api import GenerateInput
from rltool.engine.request import Request
from rltool.engine.sampling import DEFAULT_SEED, SamplingParams, make_generator
from rltool.errors import BadInputError

# Fields SGLang accepts that this engine cannot honour; a non-null value is a 400, not a silent no-op.
UNSUPPORTED_FIELDS = ("image_data", "audio_data", "video_data", "session_params",
                      "bootstrap_host", "bootstrap_port", "bootstrap_room")


def _per_item(value: Any, i: int, count: int, name: str) -> Any:
    if isinstance(value, list):
        if len(value) != count:
            raise BadInputError(f"{name} has {len(value)} entries for {count} prompts")
        return value[i]
    return value


def expand_generate(body: GenerateInput, *, tokenizer: Any, context_length: int,
                    vocab_size: int, max_requests: int, deterministic: bool,
                    moe: bool = False, lora: Any = None) -> tuple[list[Request], bool]:
    """Validate and expand a /generate body (`max_requests`: the most requests the engine ever
    holds, queued and running; `moe`: the served model has MoE layers; `lora`: the engine's LoRA
    adapters, None without --enable-lora). Returns (requests, respond_with_list)."""
    extra = body.model_extra or {}
    for name in UNSUPPORTED_FIELDS:
        if extra.get(name) not in (None, [], {}):
            raise BadInputError(f"{name} is not supported by the builtin engine")
    if (body.text is None) == (body.input_ids is None):
        raise BadInputError("send exactly one of text or input_ids")
    if body.text is not None:
        batched = isinstance(body.text, list)
        texts = body.text if batched else [body.text]
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    else:
        ids = body.input_ids
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise BadInputError("empty prompt: input_ids / text must hold at least one token")
    for p in prompts:
        bad = next((t for t in p if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BadInputError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    count = len(prompts)
    sp_raw = body.sampling_params if body.sampling_params is not None else {}
    if isinstance(sp_raw, list) and len(sp_raw) != count:
        raise BadInputError(f"sampling_params has {len(sp_raw)} entries for {count} prompts")
    params = [SamplingParams(**(sp_raw[i] if isinstance(sp_raw, list) else sp_raw))
              for i in range(count)]
    n = params[0].n
    if any(p.n != n for p in params):
        raise BadInputError("n must be the same in every sampling_params of a batch")
    if count * n > max_requests:
        raise BadInputError(f"{count} prompts x n={n} make {count * n} requests; the engine holds "
                            f"at most {max_requests} (--max-queued-requests + "
                            "--max-running-requests): lower n or split the batch")
    if isinstance(body.rid, list) and len(body.rid) != count:
        raise BadInputError(f"rid has {len(body.rid)} entries for {count} prompts")
    token_ids = body.token_ids_logprob
    if token_ids:
        if len(token_ids) > vocab_size:
            raise BadInputError(f"token_ids_logprob holds {len(token_ids)} ids, more than the "
                                f"vocabulary's {vocab_size} (SGLang sets no bound): send each "
                                "id once")
        if any(not 0 <= t < vocab_size for t in token_ids):
            raise BadInputError("token_ids_logprob holds ids outside the vocabulary")
        token_ids = list(dict.fromkeys(token_ids))

    reqs: list[Request] = []
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        if len(prompt) + sp.max_new_tokens > context_length:
            raise BadInputError(
                f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({sp.max_new_tokens}) is "
                f"longer than the model's context length ({context_length})")
        top_n = _per_item(body.top_logprobs_num, i, count, "top_logprobs_num")
        start = _per_item(body.logprob_start_len, i, count, "logprob_start_len")
        if top_n < 0 or top_n > vocab_size:
            raise BadInputError(f"top_logprobs_num must be in [0, {vocab_size}]")
        if start < -1:
            raise BadInputError("logprob_start_len must be >= -1")
        routed = bool(_per_item(body.return_routed_experts, i, count, "return_routed_experts"))
        if routed and not moe:
            raise BadInputError("return_routed_experts needs an MoE model; the served model has "
                                "no MoE layers (drop the field)")
        adapter = _per_item(body.lora_path, i, count, "lora_path")
        if adapter is not None and lora is None:
            raise BadInputError("lora_path needs an engine started with --enable-lora (drop the "
                                "field to use the served model)")
        if lora is not None:
            lora.check_name(adapter)
        base = _rid(body.rid, i, batched=batched)
        for j in range(n):
            rid = base if n == 1 else f"{base}_{j}"
            generator = None
            # A seed is honoured in either mode (SGLang ignores it outside deterministic
            # inference); deterministic mode also seeds requests that carry none.
            if not sp.greedy and (deterministic or sp.sampling_seed is not None):
                seed = sp.sampling_seed if sp.sampling_seed is not None else DEFAULT_SEED
                generator = make_generator(seed + j)
            reqs.append(Request(
                rid=rid, prompt_ids=list(prompt), params=sp,
                return_logprob=bool(_per_item(body.return_logprob, i, count, "return_logprob")),
                logprob_start_len=min(start, len(prompt) - 1), top_logprobs_num=top_n,
                token_ids_logprob=token_ids,
                return_text_in_logprobs=body.return_text_in_logprobs,
                return_routed_experts=routed, generator=generator, lora=adapter))
    return reqs, batched or n > 1


def _rid(rid: str | list[str] | None, i: int, *, batched: bool) -> str:
    if rid is None:
        return uuid.uuid4().hex
    if isinstance(rid, list):
        return rid[i]
    return f"{rid}_{i}" if batched else rid
