"""Samples, the generate-function contract, and the default single-turn generate function.

A generate function is `async def fn(sample: Sample, ctx: GenerateContext) -> Sample | list[Sample]`.
It gets the prompt row (`sample.prompt_row`, `sample.prompt_token_ids`, `sample.label`,
`sample.metadata`), the sampling parameters (`ctx.sampling`) and a client (`ctx.client`, bound to
the sample's session id), and fills the response fields: token ids, per-token rollout logprobs,
loss mask and weight versions (use `Sample.append_engine_output` / `append_tool_tokens`), status
and finish_reason. `--generate-fn module:function` loads a custom one; the built-in multi-turn
example is `rltool.rollout.calculator:generate`.

Token-in/token-out: a conversation is carried as token ids (`sample.prompt_token_ids +
sample.response_token_ids`), never re-rendered from text, so a chat template that renders earlier
turns differently cannot change tokens already generated. A sample that already holds response
tokens (a partial rollout carried over from an earlier call) continues from them.
"""

from __future__ import annotations

import importlib
import inspect
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rltool.errors import BadInputError, EngineError
from rltool.rollout.router import abort_response

# Engine finish_reason.type -> sample status.
STATUS_BY_FINISH = {"stop": "completed", "length": "truncated", "abort": "aborted"}
GenerateFn = Callable[["Sample", "GenerateContext"], Awaitable["Sample | list[Sample]"]]


@dataclass
class Sample:
    """One sample of a group, in flight or finished (a shard row once rewarded)."""

    uid: str
    prompt_id: str
    group_id: int
    sample_index: int
    prompt: str
    prompt_token_ids: list[int]
    label: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_row: Any = None
    response: str = ""
    response_token_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    status: str = "pending"
    finish_reason: str = ""
    reward: float = 0.0
    rewards: dict[str, float] | None = None
    engine_urls: list[str] = field(default_factory=list)
    teacher_logprobs: list[float] | None = None  # on-policy distillation (rollout.teachers)
    # Rollout routing replay: int32 [tokens - 1 (or fewer), MoE layers x k], the experts the
    # engine routed each token to in its last turn (-1: none); the shard's rollout_routed_experts.
    routed_experts: Any = None
    # Agentic episodes (rltool.rollout.episode): each model turn's reward and the response
    # offset where it starts; None for single-turn samples (the shard's turn_* columns).
    turn_rewards: list[float] | None = None
    turn_starts: list[int] | None = None

    @property
    def tokens(self) -> list[int]:
        """The whole conversation so far as token ids (what the next turn is conditioned on)."""
        return self.prompt_token_ids + self.response_token_ids

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "truncated", "aborted", "failed")

    def append_engine_output(self, response: dict[str, Any]) -> str:
        """Append one engine turn (model tokens: loss_mask 1); return the engine's finish type."""
        ids, logprobs, versions, finish = parse_engine_output(response)
        routed = (response.get("meta_info") or {}).get("routed_experts")
        if routed is not None:  # the turn's input and output, all but the last token
            self.routed_experts = parse_routed_experts(routed, len(self.tokens) + len(ids) - 1)
        self.response_token_ids += ids
        self.rollout_logprobs += logprobs
        self.loss_mask += [1] * len(ids)
        self.weight_versions += versions
        return finish

    def append_tool_tokens(self, ids: list[int]) -> None:
        """Append tokens the model did not generate: loss_mask 0, logprob 0.0, version -1."""
        self.response_token_ids += ids
        self.rollout_logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.weight_versions += [-1] * len(ids)

    def fail(self, reason: str) -> "Sample":
        self.status, self.finish_reason = "failed", reason
        return self


class SessionClient:
    """The client a generate function sees: one sample's session over the router.

    `generate(payload, sticky=True)` routes by the session id (consistent hashing; the
    `X-SMG-Routing-Key` header behind a gateway), which multi-turn functions should use so every
    turn meets its KV prefix on the same engine; sticky=False balances by load.
    """

    def __init__(self, router: Any, *, session_id: str,
                 request_fields: dict[str, Any] | None = None):
        self.router = router
        self.session_id = session_id
        self.request_fields = request_fields or {}  # added to every payload (the stage's)
        self.engine_urls: list[str] = []
        self.rids: list[str] = []
        self.aborted = False  # set when the batch is full: later turns are not sent

    async def generate(self, payload: dict[str, Any], *, sticky: bool = False) -> dict[str, Any]:
        if self.aborted:
            return abort_response("aborted before dispatch (the batch was full)")
        payload = {**self.request_fields, **payload}
        payload.setdefault("rid", uuid.uuid4().hex)
        self.rids.append(payload["rid"])
        response, url = await self.router.generate(
            payload, routing_key=self.session_id if sticky else None)
        self.engine_urls.append(url)
        if isinstance(response, list):  # n>1 or a batch: a generate fn sends one prompt, n=1
            if len(response) != 1:
                raise EngineError(f"engine {url} returned {len(response)} outputs for one prompt")
            response = response[0]
        return response


@dataclass
class GenerateContext:
    """What a generate function gets besides its sample."""

    client: SessionClient
    sampling: dict[str, Any]  # temperature, top_p, top_k, max_response_len, seed
    tokenizer: Any
    options: dict[str, Any] = field(default_factory=dict)

    def sampling_params(self, *, max_new_tokens: int, turn: int = 0,
                        sample: Sample | None = None, **extra: Any) -> dict[str, Any]:
        """SGLang sampling_params for one request; a seed is derived per sample and turn, and
        for a first turn that continues tokens the sample already holds (a partial rollout
        resumed in a new session) from their count too, so it does not replay the draws of the
        sample's first request."""
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens,
                                  "temperature": self.sampling["temperature"],
                                  "top_p": self.sampling["top_p"], "top_k": self.sampling["top_k"]}
        seed = self.sampling.get("seed")
        if seed is not None and sample is not None:
            held = len(sample.response_token_ids) if turn == 0 else 0
            uid = f"{sample.uid}@{held}" if held else sample.uid
            params["sampling_seed"] = derive_seed(seed, uid, turn)
        params.update(extra)
        return params


def derive_seed(seed: int, uid: str, turn: int) -> int:
    import hashlib

    digest = hashlib.blake2b(f"{seed}/{uid}/{turn}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def parse_version(value: Any) -> int:
    """Engine weight_version (a string; "default" is the initial weights) -> int policy version."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EngineError(f"engine reported weight_version {value!r}, not an integer; rltool "
                          "engines are given integer versions") from None


def parse_routed_experts(value: Any, tokens: int) -> Any:
    """SGLang's meta_info.routed_experts (base64 of int32 [tokens, layers, k]) as int32
    [tokens, layers x k]."""
    import base64
    import binascii

    import numpy as np

    try:
        flat = np.frombuffer(base64.b64decode(value, validate=True), dtype="<i4")
    except (binascii.Error, TypeError, ValueError) as e:
        raise EngineError(f"malformed routed_experts in the /generate response ({e})") from e
    if tokens <= 0 or flat.size % tokens or not flat.size:
        raise EngineError(f"engine returned {flat.size} routed expert ids for {tokens} tokens, "
                          "not a whole number per token")
    return flat.astype(np.int32).reshape(tokens, -1)


def parse_engine_output(response: dict[str, Any]) -> tuple[list[int], list[float], list[int], str]:
    """(output ids, per-token logprobs, per-token weight versions, finish type) of one response."""
    try:
        ids = [int(t) for t in response["output_ids"]]
        meta = response["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        finish = meta.get("finish_reason") or {}
    except (KeyError, TypeError) as e:
        raise EngineError(f"malformed /generate response (missing {e}); is this an SGLang-compatible "
                          "engine with return_logprob?") from e
    if len(triples) != len(ids):
        raise EngineError(f"engine returned {len(ids)} output ids but {len(triples)} logprobs")
    logprobs = [float(t[0]) for t in triples]
    if any(int(t[1]) != i for t, i in zip(triples, ids)):
        raise EngineError("engine logprob token ids differ from output_ids")
    spans = meta.get("weight_versions")
    if spans:
        versions = [parse_version(meta.get("weight_version"))] * len(ids)
        for span in spans:
            v = parse_version(span["version"])
            for i in range(max(0, int(span["start"])), min(len(ids), int(span["end"]))):
                versions[i] = v
    else:
        versions = [parse_version(meta.get("weight_version"))] * len(ids)
    finish_type = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
    return ids, logprobs, versions, finish_type


def finish_label(finish_type: str, response: dict[str, Any]) -> str:
    """finish_reason for the shard: the type plus what matched (`stop:151645`, `length`)."""
    finish = response.get("meta_info", {}).get("finish_reason") or {}
    matched = finish.get("matched") if isinstance(finish, dict) else None
    return f"{finish_type}:{matched}" if matched is not None else finish_type


async def generate_single_turn(sample: Sample, ctx: GenerateContext) -> Sample:
    """The default: one /generate call for the remaining response budget."""
    payload = single_turn_request(sample, ctx)
    if payload is None:
        return sample
    return apply_single_turn(sample, await ctx.client.generate(payload))


def single_turn_request(sample: Sample, ctx: GenerateContext) -> dict[str, Any] | None:
    """The /generate body of `generate_single_turn` for `sample` (one prompt; the batched path,
    rltool.rollout.batching, sends many of these as one body); None when the response budget is
    spent, the sample then marked truncated."""
    budget = ctx.sampling["max_response_len"] - len(sample.response_token_ids)
    if budget <= 0:
        sample.status, sample.finish_reason = "truncated", "length"
        return None
    turn = len(ctx.client.rids)
    return {"input_ids": sample.tokens, "return_logprob": True,
            "sampling_params": ctx.sampling_params(max_new_tokens=budget, turn=turn,
                                                   sample=sample)}


def apply_single_turn(sample: Sample, response: dict[str, Any]) -> Sample:
    """`sample` with the engine's answer to its `single_turn_request` appended and its status set."""
    finish = sample.append_engine_output(response)
    sample.status = STATUS_BY_FINISH.get(finish, "completed")
    sample.finish_reason = finish_label(finish, response)
    return sample


def load_generate_fn(spec: str | None) -> GenerateFn:
    """`module:function` -> the async generate function (default: single-turn)."""
    if not spec:
        return generate_single_turn
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadInputError(f"--generate-fn {spec!r}: expected module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BadInputError(f"--generate-fn {spec!r}: cannot import {module_name} ({e})") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise BadInputError(f"--generate-fn {spec!r}: {module_name} has no attribute {attr!r}")
    if not inspect.iscoroutinefunction(fn):
        raise BadInputError(f"--generate-fn {spec!r} is not an async function "
                            "(async def fn(sample, ctx) -> Sample | list[Sample])")
    return fn


def to_row(sample: Sample) -> dict[str, Any]:
    """A finished sample as a shard row (docs/formats.md schema)."""
    from rltool.data.shards import encode_routed_experts, make_row

    assert sample.finished, f"sample {sample.uid} is still {sample.status}"
    metadata = dict(sample.metadata)
    if sample.engine_urls:
        metadata["engines"] = sample.engine_urls
    routed = (None if sample.routed_experts is None else
              encode_routed_experts(sample.routed_experts, len(sample.tokens)))
    return make_row(
        uid=sample.uid, prompt_id=sample.prompt_id, group_id=sample.group_id,
        sample_index=sample.sample_index, prompt=sample.prompt,
        prompt_token_ids=sample.prompt_token_ids, response=sample.response,
        response_token_ids=sample.response_token_ids, rollout_logprobs=sample.rollout_logprobs,
        loss_mask=sample.loss_mask, weight_versions=sample.weight_versions,
        reward=float(sample.reward), rewards=sample.rewards, status=sample.status,
        finish_reason=sample.finish_reason, label=sample.label, metadata=metadata,
        teacher_logprobs=sample.teacher_logprobs, rollout_routed_experts=routed,
        turn_rewards=sample.turn_rewards, turn_starts=sample.turn_starts)


def from_row(row: dict[str, Any]) -> Sample:
    """A shard row back as a Sample (partial rollouts resume from these)."""
    import json

    from rltool.data.shards import decode_routed_experts

    metadata = json.loads(row["metadata"]) if row.get("metadata") else {}
    routed = row.get("rollout_routed_experts")
    tokens = len(row["prompt_token_ids"]) + len(row["response_token_ids"])
    engine_urls = metadata.pop("engines", [])
    rewards = row.get("rewards")
    if isinstance(rewards, list):  # pyarrow gives a map column as [(key, value), ...]
        rewards = dict(rewards)
    return Sample(
        uid=row["uid"], prompt_id=row["prompt_id"], group_id=int(row["group_id"]),
        sample_index=int(row["sample_index"]), prompt=row["prompt"],
        prompt_token_ids=list(row["prompt_token_ids"]), label=row.get("label"), metadata=metadata,
        response=row["response"], response_token_ids=list(row["response_token_ids"]),
        rollout_logprobs=list(row["rollout_logprobs"]), loss_mask=list(row["loss_mask"]),
        weight_versions=list(row["weight_versions"]), status=row["status"],
        finish_reason=row["finish_reason"], reward=float(row["reward"]), rewards=rewards,
        engine_urls=list(engine_urls),
        routed_experts=None if routed is None else decode_routed_experts(routed, tokens),
        turn_rewards=_optional_list(row.get("turn_rewards"), float),
        turn_starts=_optional_list(row.get("turn_starts"), int))


def _optional_list(value: Any, kind: type) -> list[Any] | None:
    return None if value is None else [kind(v) for v in value]
