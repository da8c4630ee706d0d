"""On-policy distillation in the train stage: teacher log-probabilities for a sample set.

Engine mode reads them from the shards' `teacher_logprobs` column (the rollout stage asked the
teacher engines). In-process mode holds each teacher as a weight snapshot tag `teacher-NAME` of
the trainer's one model (rltool.train.backuper), switched in for its pass: a teacher must have
the student's architecture and size. Per sample it stores what the estimator of --opd-mode needs
(rltool.train.algo.opd), for a mix of teachers already combined:

- sampled: the teacher's log-probability of each sampled token [L];
- topk: the student's k most likely tokens at each position (from the policy before the update)
  [L, k] and the teachers' log-probabilities at them [L, k];
- full: the teachers' log-probabilities over the whole vocabulary [L, V] (host memory: L*V*4
  bytes per sample).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rltool.data.teachers import TeacherSpec, assignments, parse_teacher_specs
from rltool.errors import BadInputError, CheckpointError, ConfigError
from rltool.logprobs import effective_temperature
from rltool.train.algo.opd import renormalise
from rltool.train.config import TrainConfig

TAG_PREFIX = "teacher-"


def resolve_teachers(cfg: TrainConfig, student_dir: Path,
                     samples: list[Any]) -> list[tuple[TeacherSpec, Path]]:
    """Each in-process teacher's weights directory, checked to share the student's tokenizer,
    and every sample's route checked to name one (before any model is built)."""
    from rltool.data.tokenizer import tokenizer_hash
    from rltool.train.checkpoint import resolve_load

    if cfg.opd_type != "inprocess":
        return []
    expected = tokenizer_hash(student_dir)
    out = []
    for spec in parse_teacher_specs(cfg.opd_teacher):
        model_dir = resolve_load(spec.location).model_dir
        if tokenizer_hash(model_dir) != expected:
            raise ConfigError(f"--opd-teacher {spec.name}={spec.location}: its tokenizer differs "
                              f"from the student's ({tokenizer_hash(model_dir)} != {expected}); "
                              "a teacher must share the student's tokenizer")
        out.append((spec, model_dir))
    for s in samples:
        assignments([spec for spec, _ in out], cfg.opd_teacher_route, s.metadata, uid=s.uid)
    return out


def load_teachers(snapshots: Any, teachers: list[tuple[TeacherSpec, Path]]) -> None:
    """Read every teacher into its snapshot tag (live weights untouched)."""
    for spec, model_dir in teachers:
        try:
            snapshots.load_dir(TAG_PREFIX + spec.name, model_dir)
        except CheckpointError as e:
            raise CheckpointError(f"--opd-teacher {spec.name}: {e}; an in-process teacher is "
                                  "switched into the student's model, so it needs the student's "
                                  "architecture and size (serve another one and use --opd-type "
                                  "engine)") from e


def _masked_mean(values: list[torch.Tensor], masks: list[torch.Tensor]) -> float:
    total = sum(float((v * m).sum()) for v, m in zip(values, masks))
    count = sum(float(m.sum()) for m in masks)
    return total / max(count, 1.0)


def prepare(cfg: TrainConfig, data: Any, samples: list[Any], *, forward: Callable[..., dict],
            switch: Callable[[str], None], temperature: float, vocab_size: int,
            batches: list[list[int]]) -> dict[str, float]:
    """Fill data.teacher_logprobs (and data.opd_ids / data.opd_teacher for topk / full) for a
    sample set whose old logprobs are known, with the actor's weights live; returns the metrics
    `opd/reverse_kl` (sampled estimate against the mixed or routed teacher) and, in-process,
    `opd/reverse_kl/NAME` per teacher. `forward(batches, **kwargs)` is the trainer's logprob
    pass (rltool.train.step.compute_logprobs) over `batches` (the set's training batches, or
    the part of them a teacher scores); `switch(tag)` restores a tag."""
    if cfg.opd_type == "off":
        return {}
    masks, old = data.masks, data.old_logprobs
    metrics: dict[str, float] = {}
    if cfg.opd_type == "engine":
        missing = [s.uid for s in samples if s.teacher_logprobs is None]
        if missing:
            raise BadInputError(f"sample {missing[0]} has no teacher_logprobs ({len(missing)} "
                                "samples); make the rollouts with --opd-teacher URL, or drop "
                                "--opd-type engine")
        data.teacher_logprobs = [torch.tensor(s.teacher_logprobs, dtype=torch.float32)
                                 for s in samples]
    else:
        metrics = _score_inprocess(cfg, data, samples, forward=forward, switch=switch,
                                   temperature=temperature, vocab_size=vocab_size,
                                   batches=batches)
    metrics["opd/reverse_kl"] = _masked_mean(
        [o - t for o, t in zip(old, data.teacher_logprobs)], masks)
    return metrics


def _score_inprocess(cfg: TrainConfig, data: Any, samples: list[Any], *,
                     forward: Callable[..., dict], switch: Callable[[str], None],
                     temperature: float, vocab_size: int,
                     batches: list[list[int]]) -> dict[str, float]:
    teachers = parse_teacher_specs(cfg.opd_teacher)
    weights = [dict((t.name, w) for t, w in assignments(teachers, cfg.opd_teacher_route,
                                                         s.metadata, uid=s.uid))
               for s in samples]
    temp = effective_temperature(temperature)
    ids = None
    if cfg.opd_mode == "topk":
        # The student's top-k set, from the policy before this set's updates (actor live).
        ids = forward(batches, top_k=min(cfg.opd_topk, vocab_size))["topk_ids"]
        data.opd_ids = ids

    def rows(i: int, logits: torch.Tensor) -> torch.Tensor:
        logprobs = torch.log_softmax(logits.float() / temp, dim=-1)
        if ids is None:
            return logprobs
        return renormalise(logprobs.gather(-1, ids[i].to(logprobs.device)))

    lengths = [m.numel() for m in data.masks]
    mixed = [torch.zeros(n) for n in lengths]
    mixed_rows: list[Any] = [None] * len(samples)
    metrics = {}
    for spec in teachers:
        own = [b for b in ([i for i in batch if spec.name in weights[i]] for batch in batches) if b]
        subset = [i for b in own for i in b]
        if not subset:
            continue
        switch(TAG_PREFIX + spec.name)
        out = forward(own, rows_fn=None if cfg.opd_mode == "sampled" else rows)
        for i in subset:
            w = weights[i][spec.name]
            mixed[i] = mixed[i] + w * out["logprobs"][i]
            if cfg.opd_mode != "sampled":
                part = w * out["rows"][i]
                mixed_rows[i] = part if mixed_rows[i] is None else mixed_rows[i] + part
        metrics[f"opd/reverse_kl/{spec.name}"] = _masked_mean(
            [data.old_logprobs[i] - out["logprobs"][i] for i in subset],
            [data.masks[i] for i in subset])
    switch("actor")
    data.teacher_logprobs = mixed
    if cfg.opd_mode != "sampled":
        data.opd_teacher = mixed_rows
    return metrics

