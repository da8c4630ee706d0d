"""Native /generate results reshaped into OpenAI's objects: a choice of an answer, a chunk of a
stream, usage and logprobs.

Results arrive in /generate's order, prompt-major: the `n` samples of a prompt are consecutive,
so choice `i` answers prompt `i // n`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from rltool.engine.routes.openai_bodies import ChatRequest, CompletionRequest

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def usage(outs: list[dict[str, Any]], n: int) -> dict[str, int]:
    """Token counts over all choices; the prompt counts once for its `n` samples."""
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs[::n])
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = sum(o["meta_info"].get("cached_tokens", 0) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish(out: dict[str, Any]) -> tuple[str | None, Any]:
    """(finish_reason, matched_stop) of a native result; (None, None) while it runs."""
    reason = out["meta_info"]["finish_reason"]
    if reason is None:
        return None, None
    return FINISH.get(reason["type"], reason["type"]), reason.get("matched")


@dataclass
class Shape(ABC):
    """How one OpenAI route presents native results: `choice` for a whole answer, `chunk` for a
    stream's update of choice `i` (`delta`: its new text, `toks_sent`: tokens already sent)."""

    tokenizer: Any

    object: ClassVar[str]  # the answer's "object"
    chunk_object: ClassVar[str]  # a stream chunk's "object"
    id_prefix: ClassVar[str]

    def token_text(self, tok: int) -> str:
        return self.tokenizer.decode([tok])

    @abstractmethod
    def choice(self, i: int, out: dict[str, Any]) -> dict[str, Any]: ...

    @abstractmethod
    def chunk(self, i: int, out: dict[str, Any], delta: str, toks_sent: int, *,
              first: bool) -> dict[str, Any]: ...


@dataclass
class CompletionShape(Shape):
    body: CompletionRequest
    prompt_texts: list[str]  # one per prompt, for `echo`

    object: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"
    id_prefix: ClassVar[str] = "cmpl"

    def choice(self, i: int, out: dict[str, Any]) -> dict[str, Any]:
        reason, matched = finish(out)
        body = self.body
        prefix = self.prompt_texts[i // body.n] if body.echo else ""
        return {"index": i, "text": prefix + out["text"],
                "logprobs": self.logprobs(out, echo=body.echo) if body.wants_logprobs else None,
                "finish_reason": reason, "matched_stop": matched}

    def chunk(self, i: int, out: dict[str, Any], delta: str, toks_sent: int, *,
              first: bool) -> dict[str, Any]:
        reason, matched = finish(out)
        body = self.body
        prefix = self.prompt_texts[i // body.n] if body.echo and first else ""
        lp = self.logprobs(out, echo=False, skip=toks_sent) if body.wants_logprobs else None
        return {"object": self.chunk_object,
                "choices": [{"index": i, "text": prefix + delta, "logprobs": lp,
                             "finish_reason": reason, "matched_stop": matched}]}

    def logprobs(self, out: dict[str, Any], *, echo: bool, skip: int = 0) -> dict[str, Any]:
        """The legacy completions logprobs object (the prompt's too with `echo`), from token
        `skip` on."""
        meta = out["meta_info"]
        triples = (meta.get("input_token_logprobs", []) if echo else []) + \
            meta.get("output_token_logprobs", [])
        tops = (meta.get("input_top_logprobs", []) if echo else []) + \
            meta.get("output_top_logprobs", [])
        triples, tops = triples[skip:], tops[skip:]
        tokens = [self.token_text(t) for _, t, _ in triples]
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"text_offset": offsets, "token_logprobs": [lp for lp, _, _ in triples],
                "tokens": tokens,
                "top_logprobs": [None if t is None else {self.token_text(x[1]): x[0] for x in t}
                                 for t in tops] if tops else [None] * len(tokens)}


@dataclass
class ChatShape(Shape):
    body: ChatRequest

    object: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"
    id_prefix: ClassVar[str] = "chatcmpl"

    def choice(self, i: int, out: dict[str, Any]) -> dict[str, Any]:
        reason, matched = finish(out)
        return {"index": i, "message": {"role": "assistant", "content": out["text"],
                                        "reasoning_content": None, "tool_calls": None},
                "logprobs": self.logprobs(out) if self.body.logprobs else None,
                "finish_reason": reason, "matched_stop": matched}

    def chunk(self, i: int, out: dict[str, Any], delta: str, toks_sent: int, *,
              first: bool) -> dict[str, Any]:
        reason, matched = finish(out)
        msg: dict[str, Any] = {"content": delta}
        if first:
            msg["role"] = "assistant"
        return {"object": self.chunk_object,
                "choices": [{"index": i, "delta": msg,
                             "logprobs": self.logprobs(out, skip=toks_sent)
                             if self.body.logprobs else None,
                             "finish_reason": reason, "matched_stop": matched}]}

    def logprobs(self, out: dict[str, Any], *, skip: int = 0) -> dict[str, Any]:
        """The chat logprobs object of the output tokens from token `skip` on."""
        meta = out["meta_info"]
        tops = meta.get("output_top_logprobs") or []
        content = []
        for j, (lp, tok, _) in enumerate(meta.get("output_token_logprobs", [])[skip:],
                                         start=skip):
            text = self.token_text(tok)
            content.append({"token": text, "bytes": list(text.encode()), "logprob": lp,
                            "top_logprobs": [{"token": self.token_text(t),
                                              "bytes": list(self.token_text(t).encode()),
                                              "logprob": v}
                                             for v, t, _ in (tops[j] if j < len(tops) else [])]})
        return {"content": content}
