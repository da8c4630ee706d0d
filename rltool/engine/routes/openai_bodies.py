"""The request bodies of the OpenAI routes and their translation into a /generate body.

An OpenAI request becomes a `GenerateInput` (`to_generate`) and takes /generate's own path from
there (`EngineState.expand`: prompts, sampling params, `n > 1`, the checks of what the engine can
honour), so the two APIs cannot drift apart. Extra top-level keys are ignored (gateways add
their own); `model` is not checked against the served name (as SGLang).
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request as HttpRequest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rltool.engine.api import GenerateInput
from rltool.errors import BadInputError

B = TypeVar("B", bound=BaseModel)


class OpenAIRequest(BaseModel):
    """What completions and chat completions share: sampling (OpenAI's fields and SGLang's
    extras), `n` and streaming."""

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
    lora_path: str | None = None  # --enable-lora: a loaded adapter (None: the policy adapter)

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """/generate's `sampling_params`; unset fields are left out (the engine's defaults)."""
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


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, gt=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)

    @property
    def prompts(self) -> list[Any]:
        """The prompts of the batch: texts or token id lists."""
        p = self.prompt
        batched = isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))
        return p if batched else [p]

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def to_generate(self) -> GenerateInput:
        items = self.prompts
        is_text = isinstance(items[0], str)
        return GenerateInput(text=items if is_text else None,
                             input_ids=None if is_text else items,
                             sampling_params=self.sampling_params(self.max_tokens), rid=self.rid,
                             return_logprob=self.wants_logprobs,
                             top_logprobs_num=self.logprobs or 0,
                             logprob_start_len=0 if self.echo and self.wants_logprobs else -1,
                             lora_path=self.lora_path)


class ChatRequest(OpenAIRequest):
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

    def check_supported(self) -> None:
        """Refuse what the builtin engine cannot honour (tools, structured output)."""
        if self.tools:
            raise BadInputError("tool calling is not supported by the builtin engine")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise BadInputError("response_format other than text is not supported")

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        """The prompt: `input_ids` when given, else the messages through the chat template."""
        if self.input_ids is not None:
            return self.input_ids
        messages = []
        for i, m in enumerate(self.messages):
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(_text_part(part, f"messages[{i}].content[{j}]")
                                  for j, part in enumerate(content))
            messages.append({**m, "content": content if content is not None else ""})
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True,
                                                 **(self.chat_template_kwargs or {}))
        except Exception as e:  # jinja errors: the messages do not fit the template
            raise BadInputError(f"cannot apply the chat template: {e}") from e
        return tokenizer.encode(text, add_special_tokens=False)

    def to_generate(self, prompt_ids: list[int], *, context_length: int) -> GenerateInput:
        """Without a token limit the answer may fill the context."""
        max_new = self.max_completion_tokens or self.max_tokens or max(
            context_length - len(prompt_ids), 1)
        top_n = (self.top_logprobs or 0) if self.logprobs else 0
        return GenerateInput(input_ids=prompt_ids, sampling_params=self.sampling_params(max_new),
                             rid=self.rid, return_logprob=self.logprobs, top_logprobs_num=top_n,
                             lora_path=self.lora_path)


def _text_part(part: Any, where: str) -> str:
    """The text of an OpenAI content part (`where` names it); only text parts are understood."""
    if not isinstance(part, dict):
        raise BadInputError(f'{where} must be a content part {{"type": "text", "text": ...}}, '
                            f"not {type(part).__name__}")
    if part.get("type") != "text":
        raise BadInputError(f"{where} is a {part.get('type')!r} part: only text message content "
                            "is supported")
    if not isinstance(part.get("text"), str):
        raise BadInputError(f"{where}.text must be a string")
    return part["text"]


def parse_request(request: HttpRequest, raw: bytes, model: type[B]) -> B:
    """Validate the body `raw` of `request` (read by `read_body`, which refuses one over the size
    limit with 413 as on every route); any failure is a BadInputError naming the fields."""
    if "application/json" not in request.headers.get("content-type", ""):
        raise BadInputError("Content-Type must be application/json")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise BadInputError("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                      for x in e.errors())) from e
