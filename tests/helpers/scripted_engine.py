"""A scripted engine for multi-turn rollout tests: each /generate answers with the next scripted
(text, finish_reason), tokenized by the real tokenizer and cut at max_new_tokens; a turn ending on
a stop string is reported the way SGLang does ({type: stop, matched})."""

from __future__ import annotations


class ScriptedEngine:
    """Every turn weight version "3" and logprob -0.25 per token; subclasses change either."""

    url = "http://scripted"

    def __init__(self, tok, script):
        self.tok, self.script, self.payloads = tok, list(script), []

    def version(self) -> str:
        return "3"

    def logprob(self, i: int) -> float:
        return -0.25

    async def generate(self, payload, *, routing_key=None):
        self.payloads.append(payload)
        text, finish = self.script.pop(0)
        ids = self.tok.encode(text, add_special_tokens=False)
        ids = ids[:payload["sampling_params"]["max_new_tokens"]]
        return {"text": text, "output_ids": ids, "meta_info": {
            "finish_reason": finish, "weight_version": self.version(),
            "output_token_logprobs": [[self.logprob(i), t, None] for i, t in enumerate(ids)]}}

    async def health(self):
        return True

    async def abort_request(self, *, rid="", abort_all=False):
        pass

    async def aclose(self):
        pass
