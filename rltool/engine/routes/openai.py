"""OpenAI-compatible routes of the builtin engine: /v1/models, /v1/completions, /v1/chat/completions.

Each request becomes native /generate requests (same scheduler, same sampling and logprob
convention) and the native results are reshaped into OpenAI's objects. Extra top-level keys are
ignored (gateways add their own); `model` is not checked against the served name (as SGLang).
Errors use OpenAI's `{"object":"error",...}` object; in streams they arrive as
`data: {"error": {...}}` followed by `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rltool.engine import api
from rltool.engine.api import GenerateInput
from rltool.engine.routes.base import EngineState, read_body, sse as _sse
from rltool.errors import BadInputError, EngineError

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    rid: str | None = None

    def sampling(self, max_new_tokens: int) -> dict[str, Any]:
        sp = {"max_new_tokens": max_new_tokens, "temperature": self.temperature,
              "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p, "n": self.n,
              "stop": self.stop, "stop_token_ids": self.stop_token_ids,
              "sampling_seed": self.seed, "frequency_penalty": self.frequency_penalty,
              "presence_penalty": self.presence_penalty,
              "repetition_penalty": self.repetition_penalty, "logit_bias": self.logit_bias,
              "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
              "no_stop_trim": self.no_stop_trim, "regex": self.regex,
              "json_schema": self.json_schema}
        return {k: v for k, v in sp.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, gt=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    max_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    input_ids: list[int] | None = None


def openai_error(message: str, code: int = 400) -> JSONResponse:
    kind = "Bad Request" if code == 400 else "Too Many Requests" if code == 429 else "Error"
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": None,
                         "code": code}, status_code=code)


def _usage(outs: list[dict[str, Any]], n: int) -> dict[str, int]:
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs[::n])
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = sum(o["meta_info"].get("cached_tokens", 0) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish(out: dict[str, Any]) -> tuple[str | None, Any]:
    reason = out["meta_info"]["finish_reason"]
    if reason is None:
        return None, None
    return FINISH.get(reason["type"], reason["type"]), reason.get("matched")


def router(state: EngineState) -> APIRouter:
    r = APIRouter()
    runner = state.runner
    tokenizer = runner.tokenizer
    served = state.served_model_name
    expand, run, updates = state.expand, state.run, state.updates

    def token_text(tok: int) -> str:
        return tokenizer.decode([tok])

    async def parse(request: HttpRequest, model: type[BaseModel]) -> BaseModel:
        if "application/json" not in request.headers.get("content-type", ""):
            raise BadInputError("Content-Type must be application/json")
        raw = await read_body(request)
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            raise BadInputError("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                          for x in e.errors())) from e

    async def answer(body: _Common, gen: GenerateInput, *, shape: Callable, chunk: Callable,
                     kind: str) -> Response:
        try:
            reqs, _ = expand(gen)
        except BadInputError as e:
            return openai_error(str(e))
        rid = f"{kind}-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": rid, "created": created, "model": body.model or served}
        if body.stream:
            obj = "chat.completion.chunk" if kind == "chatcmpl" else "text_completion"
            return StreamingResponse(stream(reqs, body, head, chunk, obj=obj),
                                     media_type="text/event-stream")
        try:
            outs = await run(reqs)
        except EngineError as e:
            return openai_error(str(e), 429 if "queued" in str(e) else 503)
        choices = [shape(i, out) for i, out in enumerate(outs)]
        return JSONResponse({**head, "object": "chat.completion" if kind == "chatcmpl"
                             else "text_completion", "choices": choices,
                             "usage": _usage(outs, body.n),
                             "metadata": {"weight_version": runner.weight_version}})

    async def stream(reqs: list, body: _Common, head: dict[str, Any], chunk: Callable, *,
                     obj: str) -> AsyncIterator[bytes]:
        sent: dict[int, tuple[str, int]] = {}  # index -> (text sent, tokens sent)
        finals: dict[int, dict[str, Any]] = {}
        try:
            async for i, final, out in updates(reqs):
                text_sent, toks_sent = sent.get(i, ("", 0))
                text = out["text"]
                delta = text[len(text_sent):] if text.startswith(text_sent) else ""
                yield _sse({**head, **chunk(i, out, delta, toks_sent, first=i not in sent)})
                sent[i] = (text_sent + delta, len(out["output_ids"]))
                if final:
                    finals[i] = out
        except (BadInputError, EngineError) as e:
            yield _sse({"error": {"message": str(e), "type": "invalid_request_error",
                                  "code": 400, "retryable": False}})
        else:
            if body.include_usage:
                outs = [finals[i] for i in sorted(finals)]
                yield _sse({**head, "object": obj, "choices": [],
                            "usage": _usage(outs, body.n)})
        yield b"data: [DONE]\n\n"

    # ----- /v1/models --------------------------------------------------------------------

    def card() -> dict[str, Any]:
        return {"id": served, "object": "model", "created": int(state.started_wall_s),
                "owned_by": "sglang", "root": served, "parent": None,
                "max_model_len": runner.context_length}

    @r.get(api.OPENAI_MODELS)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @r.get(api.OPENAI_MODELS + "/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != served:
            return JSONResponse({"error": {"message": f"model {model_id!r} not found",
                                           "type": "invalid_request_error", "param": None,
                                           "code": "model_not_found"}}, status_code=404)
        return JSONResponse(card())

    # ----- /v1/completions ---------------------------------------------------------------

    def completion_logprobs(out: dict[str, Any], *, echo: bool, skip: int = 0) -> dict[str, Any]:
        meta = out["meta_info"]
        triples = (meta.get("input_token_logprobs", []) if echo else []) + \
            meta.get("output_token_logprobs", [])
        tops = (meta.get("input_top_logprobs", []) if echo else []) + \
            meta.get("output_top_logprobs", [])
        triples, tops = triples[skip:], tops[skip:]
        tokens = [token_text(t) for _, t, _ in triples]
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"text_offset": offsets, "token_logprobs": [lp for lp, _, _ in triples],
                "tokens": tokens,
                "top_logprobs": [None if t is None else {token_text(x[1]): x[0] for x in t}
                                 for t in tops] if tops else [None] * len(tokens)}

    @r.post(api.OPENAI_COMPLETIONS)
    async def completions(request: HttpRequest) -> Response:
        try:
            body = await parse(request, CompletionRequest)
        except BadInputError as e:
            return openai_error(str(e))
        p = body.prompt
        batched = isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))
        items = p if batched else [p]
        is_text = isinstance(items[0], str)
        want_lp = body.logprobs is not None
        gen = GenerateInput(text=items if is_text else None, input_ids=None if is_text else items,
                            sampling_params=body.sampling(body.max_tokens), rid=body.rid,
                            return_logprob=want_lp, top_logprobs_num=body.logprobs or 0,
                            logprob_start_len=0 if body.echo and want_lp else -1)
        prompt_texts = [it if isinstance(it, str) else tokenizer.decode(it) for it in items]

        def shape(i: int, out: dict[str, Any]) -> dict[str, Any]:
            reason, matched = _finish(out)
            prefix = prompt_texts[i // body.n] if body.echo else ""
            return {"index": i, "text": prefix + out["text"],
                    "logprobs": completion_logprobs(out, echo=body.echo) if want_lp else None,
                    "finish_reason": reason, "matched_stop": matched}

        def chunk(i: int, out: dict[str, Any], delta: str, toks_sent: int, *,
                  first: bool) -> dict[str, Any]:
            reason, matched = _finish(out)
            prefix = prompt_texts[i // body.n] if body.echo and first else ""
            lp = completion_logprobs(out, echo=False, skip=toks_sent) if want_lp else None
            return {"object": "text_completion",
                    "choices": [{"index": i, "text": prefix + delta, "logprobs": lp,
                                 "finish_reason": reason, "matched_stop": matched}]}

        return await answer(body, gen, shape=shape, chunk=chunk, kind="cmpl")

    # ----- /v1/chat/completions ----------------------------------------------------------

    def chat_logprobs(out: dict[str, Any], *, skip: int = 0) -> dict[str, Any]:
        meta = out["meta_info"]
        tops = meta.get("output_top_logprobs") or []
        content = []
        for j, (lp, tok, _) in enumerate(meta.get("output_token_logprobs", [])[skip:], start=skip):
            text = token_text(tok)
            content.append({"token": text, "bytes": list(text.encode()), "logprob": lp,
                            "top_logprobs": [{"token": token_text(t), "bytes":
                                              list(token_text(t).encode()), "logprob": v}
                                             for v, t, _ in (tops[j] if j < len(tops) else [])]})
        return {"content": content}

    def chat_prompt(body: ChatRequest) -> list[int]:
        if body.input_ids is not None:
            return body.input_ids
        messages = []
        for m in body.messages:
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: only text is understood
                if any(part.get("type") != "text" for part in content):
                    raise BadInputError("only text message content is supported")
                content = "".join(part.get("text", "") for part in content)
            messages.append({**m, "content": content if content is not None else ""})
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True,
                                                 **(body.chat_template_kwargs or {}))
        except Exception as e:  # jinja errors: the messages do not fit the template
            raise BadInputError(f"cannot apply the chat template: {e}") from e
        return tokenizer.encode(text, add_special_tokens=False)

    @r.post(api.OPENAI_CHAT_COMPLETIONS)
    async def chat(request: HttpRequest) -> Response:
        try:
            body = await parse(request, ChatRequest)
            if body.tools:
                raise BadInputError("tool calling is not supported by the builtin engine")
            if body.response_format and body.response_format.get("type") not in (None, "text"):
                raise BadInputError("response_format other than text is not supported")
            ids = chat_prompt(body)
        except BadInputError as e:
            return openai_error(str(e))
        max_new = body.max_completion_tokens or body.max_tokens or max(
            runner.context_length - len(ids), 1)
        top_n = (body.top_logprobs or 0) if body.logprobs else 0
        gen = GenerateInput(input_ids=ids, sampling_params=body.sampling(max_new), rid=body.rid,
                            return_logprob=body.logprobs, top_logprobs_num=top_n)

        def shape(i: int, out: dict[str, Any]) -> dict[str, Any]:
            reason, matched = _finish(out)
            return {"index": i, "message": {"role": "assistant", "content": out["text"],
                                            "reasoning_content": None, "tool_calls": None},
                    "logprobs": chat_logprobs(out) if body.logprobs else None,
                    "finish_reason": reason, "matched_stop": matched}

        def chunk(i: int, out: dict[str, Any], delta: str, toks_sent: int, *,
                  first: bool) -> dict[str, Any]:
            reason, matched = _finish(out)
            msg: dict[str, Any] = {"content": delta}
            if first:
                msg["role"] = "assistant"
            return {"object": "chat.completion.chunk",
                    "choices": [{"index": i, "delta": msg,
                                 "logprobs": chat_logprobs(out, skip=toks_sent)
                                 if body.logprobs else None,
                                 "finish_reason": reason, "matched_stop": matched}]}

        return await answer(body, gen, shape=shape, chunk=chunk, kind="chatcmpl")

    return r
