"""Training samples: read from rollout shards (or an SFT prompts file).

A `Sample` is one row: prompt tokens, response tokens, per-token loss mask and rollout logprobs,
reward and group. A `SampleSet` is everything one train run consumes, with a content id that
checkpoints record so a resumed run can tell it is continuing the same data.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from rltool.errors import BadInputError, ShardSchemaError

log = logging.getLogger(__name__)
SHARD_COLUMNS = ["uid", "group_id", "prompt_token_ids", "response_token_ids", "rollout_logprobs",
                 "loss_mask", "reward", "status", "teacher_logprobs", "metadata",
                 "rollout_routed_experts", "turn_rewards", "turn_starts"]


@dataclass
class Sample:
    uid: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    reward: float
    group: int  # dense group index across all shards of the set
    metadata: dict[str, Any] = field(default_factory=dict)
    teacher_logprobs: list[float] | None = None  # engine-mode on-policy distillation
    # int32 [tokens - 1, MoE layers x k] (-1: none), the shard's rollout_routed_experts
    routed_experts: Any = None
    turn_rewards: list[float] | None = None  # agentic episodes (rltool.train.algo.multiturn)
    turn_starts: list[int] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def response_start(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class SampleSet:
    samples: list[Sample]
    temperature: float
    set_id: str                      # xxh3-64 over the inputs' manifests / file bytes
    sources: list[str] = field(default_factory=list)
    rollout_step: int = 0            # the newest shard's step (0 for SFT prompts)
    # Groups left out because one of their samples is `failed` (its reward raised or timed out,
    # or its generation failed): a failed sample's reward 0.0 is not a score, and with it the
    # group's advantages would be wrong for every member.
    failed_groups: int = 0
    failed_group_samples: int = 0    # samples (failed or not) in those groups


def load_rollouts(shard_dirs: list[str | os.PathLike], *, tokenizer_hash: str,
                  vocab_size: int, routed_experts: bool = False) -> SampleSet:
    """Open, verify and read shards; refuse a tokenizer mismatch, mixed temperatures, bad ids,
    and with `routed_experts` (rollout routing replay) a sample without them.

    Groups that contain a `failed` sample are left out (and counted in the SampleSet)."""
    from rltool.data.shards import MANIFEST, decode_routed_experts, open_shard

    samples: list[Sample] = []
    group_index: dict[tuple[int, int], int] = {}
    temperatures: set[float] = set()
    h = xxhash.xxh3_64()
    step = 0
    failed_groups = failed_group_samples = 0
    for k, d in enumerate(shard_dirs):
        shard = open_shard(d, expected_tokenizer_hash=tokenizer_hash)
        h.update((Path(d) / MANIFEST).read_bytes())
        step = max(step, shard.meta.step)
        if "temperature" not in shard.meta.sampling:
            raise ShardSchemaError(f"{d}: file metadata sampling has no temperature; the trainer "
                                   "needs it to recompute logprobs (the rltool.logprobs convention)")
        temperatures.add(float(shard.meta.sampling["temperature"]))
        rows = [row for batch in shard.iter_batches(columns=SHARD_COLUMNS)
                for row in batch.to_pylist()]
        failed = {row["group_id"] for row in rows if row["status"] == "failed"}
        failed_groups += len(failed)
        for row in rows:
            if row["group_id"] in failed:
                failed_group_samples += 1
                continue
            g = group_index.setdefault((k, row["group_id"]), len(group_index))
            sample = Sample(uid=row["uid"], prompt_ids=row["prompt_token_ids"],
                            response_ids=row["response_token_ids"], loss_mask=row["loss_mask"],
                            rollout_logprobs=row["rollout_logprobs"],
                            reward=float(row["reward"]), group=g,
                            metadata=json.loads(row["metadata"] or "{}"),
                            teacher_logprobs=row["teacher_logprobs"],
                            turn_rewards=row["turn_rewards"], turn_starts=row["turn_starts"])
            if row["rollout_routed_experts"] is not None:
                sample.routed_experts = decode_routed_experts(row["rollout_routed_experts"],
                                                              sample.num_tokens)
            elif routed_experts:
                raise BadInputError(f"--use-rollout-routing-replay: sample {sample.uid} of {d} "
                                    "has no rollout_routed_experts; re-run the rollout with "
                                    "--use-rollout-routing-replay against an MoE engine, or "
                                    "train without the flag")
            _check_sample(sample, where=str(d), vocab_size=vocab_size)
            samples.append(sample)
    if len(temperatures) > 1:
        raise BadInputError(f"shards were sampled at different temperatures {sorted(temperatures)}; "
                            "train on shards of one temperature per run")
    if not samples and failed_groups:
        raise ShardSchemaError(f"{', '.join(map(str, shard_dirs))}: every group ({failed_groups}) "
                               "holds a failed sample, so there is nothing to train on; fix the "
                               "reward or engines (finish_reason says which) and re-run rollout")
    if not samples:
        raise ShardSchemaError(f"{', '.join(map(str, shard_dirs))}: no rows to train on")
    if failed_groups:
        log.warning("left out %d groups (%d samples) that hold a failed sample", failed_groups,
                    failed_group_samples)
    return SampleSet(samples=samples, temperature=temperatures.pop(), set_id=h.hexdigest(),
                     sources=[str(d) for d in shard_dirs], rollout_step=step,
                     failed_groups=failed_groups, failed_group_samples=failed_group_samples)


def _check_sample(sample: Sample, *, where: str, vocab_size: int) -> None:
    if not sample.prompt_ids:
        raise ShardSchemaError(f"{where}: sample {sample.uid} has an empty prompt; the first "
                               "response token needs a context")
    bad = [t for t in sample.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ShardSchemaError(f"{where}: sample {sample.uid} has token id {bad[0]} outside the "
                               f"model's vocabulary [0, {vocab_size})")
    if any(m not in (0, 1) for m in sample.loss_mask):
        raise ShardSchemaError(f"{where}: sample {sample.uid} has a loss_mask value other than 0/1")


def load_sft_prompts(path: str | os.PathLike, *, tokenizer: Any) -> SampleSet:
    """SFT samples from prompt rows {prompt, label}: the user turn under the chat template with the
    generation prompt (as the rollout stage renders it), and the target label + EOS."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError as e:
        raise BadInputError(f"--prompts {path}: no such file") from e
    samples = []
    for n, line in enumerate(data.decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, label = row["prompt"], row["label"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise BadInputError(f"{path}:{n}: not a prompt row with 'prompt' and 'label' "
                                f"({e})") from e
        if label is None:
            raise BadInputError(f"{path}:{n}: label is null; SFT needs a target")
        prompt_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
        target = tokenizer.encode(str(label), add_special_tokens=False) + [tokenizer.eos_token_id]
        samples.append(Sample(uid=str(row.get("prompt_id", n)), prompt_ids=prompt_ids,
                              response_ids=target, loss_mask=[1] * len(target),
                              rollout_logprobs=[0.0] * len(target), reward=0.0, group=len(samples)))
    if not samples:
        raise BadInputError(f"--prompts {path}: no prompt rows")
    return SampleSet(samples=samples, temperature=1.0, set_id=xxhash.xxh3_64_hexdigest(data),
                     sources=[str(path)])
