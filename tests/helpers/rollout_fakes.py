"""An in-process fake of the engine HTTP client, for routing and collection tests without servers.

It answers /generate in SGLang's shape: output ids drawn from a per-request RNG, logprobs, a
weight version, finish types `stop` / `length`, and `abort` for requests aborted by rid.
"""

from __future__ import annotations

import asyncio
import random

from rltool.errors import EngineError

EOS = 2


class FakeEngine:
    def __init__(self, url: str, *, delay_s: float = 0.0, version: str = "0", eos_prob: float = 0.2,
                 spans: list[dict] | None = None):
        self.url = url
        self.delay_s = delay_s
        self.version = version
        self.eos_prob = eos_prob
        self.spans = spans
        self.dead = False
        self.requests: list[dict] = []  # one per prompt (a batch's prompts each)
        self.bodies: list[int] = []  # the prompts of each /generate call (HTTP request)
        self.keys: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.aborted: set[str] = set()

    async def generate(self, payload: dict, *, routing_key: str | None = None) -> dict | list:
        ids = payload["input_ids"]
        batched = bool(ids) and isinstance(ids[0], list)
        self.bodies.append(len(ids) if batched else 1)
        if batched:  # one request per prompt, as engines do
            items = [{**payload, "input_ids": x, "sampling_params": p, "rid": r}
                     for x, p, r in zip(ids, payload["sampling_params"], payload["rid"])]
            return list(await asyncio.gather(*(self._one(x, routing_key) for x in items)))
        return await self._one(payload, routing_key)

    async def _one(self, payload: dict, routing_key: str | None) -> dict:
        if self.dead:
            raise EngineError(f"{self.url}: connection refused")
        self.requests.append(payload)
        self.keys.append(routing_key)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            rng = random.Random(f"{payload['input_ids']}/{payload.get('rid')}")
            budget = payload["sampling_params"]["max_new_tokens"]
            ids: list[int] = []
            finish = {"type": "length", "length": budget}
            for _ in range(budget):
                await asyncio.sleep(self.delay_s)
                if self.dead:
                    raise EngineError(f"{self.url}: connection reset")
                if payload.get("rid") in self.aborted:
                    finish = {"type": "abort", "message": "aborted", "status_code": None,
                              "err_type": None}
                    break
                tok = EOS if rng.random() < self.eos_prob else rng.randrange(5, 40)
                ids.append(tok)
                if tok == EOS:
                    finish = {"type": "stop", "matched": EOS}
                    break
            meta = {"id": payload.get("rid"), "finish_reason": finish,
                    "prompt_tokens": len(payload["input_ids"]), "completion_tokens": len(ids),
                    "weight_version": self.version,
                    "output_token_logprobs": [[-0.5 - 0.01 * t, t, None] for t in ids]}
            if self.spans is not None:
                meta["weight_versions"] = self.spans
            return {"text": "".join(chr(97 + t % 26) for t in ids), "output_ids": ids,
                    "meta_info": meta}
        finally:
            self.in_flight -= 1

    async def health(self) -> bool:
        if self.dead:
            raise EngineError(f"{self.url}: connection refused")
        return True

    async def abort_request(self, *, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.add(rid)

    async def aclose(self) -> None:
        pass


class FakeTokenizer:
    """decode only (the collector decodes response tokens for the reward)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids if not (skip_special_tokens and t == EOS))
