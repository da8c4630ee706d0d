"""One batch of the asynchronous loop, taken from the rollout stream and written as the step's
shard (the commit point of its samples), with the stream's positions in the shard's metadata
(`extra.async`, docs/formats.md) and its metrics line in rollout.jsonl."""

from __future__ import annotations

import time
from pathlib import Path

from rltool import atomic
from rltool.loop.async_rollout import RolloutStream
from rltool.loop.async_staleness import staleness_metrics
from rltool.rollout.stage import RolloutConfig


def write_batch(stream: RolloutStream, cfg: RolloutConfig, *, train_version: int) -> float:
    """Wait for `cfg.rollout_batch_size` groups young enough for `train_version`, write them as
    `cfg.out`; the seconds it took."""
    from rltool.rollout.metrics import rollout_metrics
    from rltool.rollout.stage import CONFIG_NAME, PRODUCER, write_metrics

    t0 = time.perf_counter()
    groups, dropped, waited = stream.take(cfg.rollout_batch_size, train_version=train_version)
    groups.sort(key=lambda g: g[0].group_id)
    held, next_position = stream.positions()
    metrics = staleness_metrics(groups, train_version=train_version,
                                dropped_groups=len(dropped))
    metrics["rollout/wait_time"] = waited
    extra = {"filter": "none", "partial": False, "async": {
        "held": held, "next_position": next_position,
        "dropped": [g[0].group_id for g in dropped], "train_version": train_version,
        "metrics": metrics}}
    meta = stream.inputs.shard_meta(cfg, producer=PRODUCER, extra=extra)
    atomic.remove_stale_temporaries(Path(cfg.out).parent)
    stream.inputs.write(cfg, groups, meta=meta, config_name=CONFIG_NAME)
    output_tokens = sum(sum(s.loss_mask) for g in groups for s in g)
    write_metrics(cfg, {**rollout_metrics(groups, counts={}, output_tokens=output_tokens,
                                          elapsed_s=waited, redispatched=0), **metrics},
                  default_name="rollout.jsonl")
    return time.perf_counter() - t0
