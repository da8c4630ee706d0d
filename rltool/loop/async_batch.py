"""One batch of the asynchronous loop, taken from the rollout stream and written as the step's
shard (the commit point of its samples), with the stream's positions in the shard's metadata
(`extra.async`, docs/formats.md) and its metrics line in rollout.jsonl.

`Prepared` does that on a thread of its own, so the next step's batch is taken and its shard
written while the trainer still trains the current one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rltool import atomic
from rltool.loop.async_rollout import RolloutStream
from rltool.loop.async_staleness import staleness_metrics
from rltool.rollout.stage import RolloutConfig


def write_batch(stream: RolloutStream, cfg: RolloutConfig, *, train_version: int) -> float:
    """Wait for `cfg.rollout_batch_size` groups young enough for `train_version`, write them as
    `cfg.out`; the seconds it took."""
    from rltool.rollout.collect import reward_counts
    from rltool.rollout.metrics import rollout_metrics
    from rltool.rollout.stage import CONFIG_NAME, PRODUCER, check_reward_failures, write_metrics

    t0 = time.perf_counter()
    groups, dropped, waited = stream.take(cfg.rollout_batch_size, train_version=train_version)
    groups.sort(key=lambda g: g[0].group_id)
    counts, first_failure = reward_counts(groups, rewarded=stream.inputs.reward_fn is not None)
    check_reward_failures(counts, first_failure, max_frac=cfg.max_failed_rewards_frac,
                          step=cfg.step)
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
    write_metrics(cfg, {**rollout_metrics(groups, counts=counts, output_tokens=output_tokens,
                                          elapsed_s=waited, redispatched=0), **metrics},
                  default_name="rollout.jsonl")
    return time.perf_counter() - t0


class Prepared:
    """The batch of `cfg.out`, taken and written by `write_batch` on a daemon thread (a worker
    stopped meanwhile leaves no shard, or a complete one: the shard is published atomically)."""

    def __init__(self, stream: RolloutStream, cfg: RolloutConfig, *, train_version: int):
        self.out = cfg.out
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(stream, cfg, train_version),
                                        name="rltool-prepare-batch", daemon=True)
        self._thread.start()

    def _run(self, stream: RolloutStream, cfg: RolloutConfig, train_version: int) -> None:
        try:
            write_batch(stream, cfg, train_version=train_version)
        except BaseException as e:  # noqa: BLE001 - raised to the caller by wait()
            self._error = e

    def wait(self) -> float:
        """Block until the shard is written (re-raising what failed); the seconds waited."""
        t0 = time.perf_counter()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return time.perf_counter() - t0
