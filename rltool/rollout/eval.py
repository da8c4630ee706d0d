"""The eval stage: every prompt of a held-out file, K samples each -> eval shard + pass@k metrics.

`run(cfg)` is the library entry (the loop calls it every few steps); `rltool eval` is its command.
Eval never feeds training: its shard goes to `--out` (the loop uses RUN/eval/step-K/) and its
metrics to `eval.jsonl` (next to `--out` unless `--metrics`). There is no filtering, no
over-sampling and no carry-over; every prompt of the file (or the first `--max-prompts`) is
sampled once as a group of `--n-samples-per-prompt`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pydantic import Field

from rltool.config import write_resolved
from rltool.rollout.stage import EngineStageConfig, StageInputs, check_engines_left, write_metrics

PRODUCER = "rltool eval"
CONFIG_NAME = "eval_config.toml"


class EvalConfig(EngineStageConfig):
    """`rltool eval`: evaluation shards and pass@k metrics on held-out prompts."""

    max_prompts: int | None = Field(None, ge=1, description="Evaluate only the first N prompts "
                                    "of the file (default: all).")
    pass_threshold: float = Field(1.0, description="A sample passes (for pass@1 / pass@k) when "
                                  "its reward is at least this.")


def run(cfg: EvalConfig) -> dict[str, Any]:
    """Evaluate; returns {out, rows, metrics, metrics_path, engines}."""
    from rltool.data.shards import ShardMeta, write_shard
    from rltool.rollout.collect import Collector
    from rltool.rollout.generate import to_row
    from rltool.rollout.metrics import RolloutProgress, eval_metrics

    inputs = StageInputs(cfg)
    n = cfg.n_samples_per_prompt
    num_prompts = min(cfg.max_prompts or len(inputs.prompts), len(inputs.prompts))
    source = (inputs.new_group(p, n=n, uid_prefix=f"eval{cfg.step:06d}")
              for p in range(num_prompts))
    sampling = cfg.sampling()

    async def collect() -> tuple[Any, dict[str, Any]]:
        router = inputs.make_router(cfg)
        try:
            with RolloutProgress(total_groups=num_prompts, total_samples=num_prompts * n,
                                 quiet=cfg.quiet, label="eval") as progress:
                collector = Collector(router=router, tokenizer=inputs.tokenizer,
                                      generate_fn=inputs.generate_fn, sampling=sampling,
                                      reward_fn=inputs.reward_fn,
                                      reward_timeout_s=cfg.reward_timeout_s,
                                      reward_workers=cfg.reward_workers, progress=progress)
                result = await collector.run(source, target_groups=num_prompts)
            return result, router.stats()
        finally:
            await router.aclose()

    result, router_stats = asyncio.run(collect())
    check_engines_left(router_stats)
    meta = ShardMeta(tokenizer_hash=inputs.tokenizer_hash, step=cfg.step, producer=PRODUCER,
                     sampling=sampling, extra={"prompts": str(cfg.prompts), "reward": cfg.reward,
                                               "engines": inputs.urls})
    manifest = write_shard(cfg.out, [to_row(s) for g in result.kept for s in g], meta)
    write_resolved(cfg.model_copy(update={"api_key": None}), Path(cfg.out) / CONFIG_NAME)
    metrics = eval_metrics(result.kept, pass_threshold=cfg.pass_threshold,
                           elapsed_s=result.elapsed_s, output_tokens=result.output_tokens)
    versions = [v for g in result.kept for s in g for v in s.weight_versions if v >= 0]
    metrics["eval/weight_version/max"] = max(versions, default=-1)
    metrics_path = write_metrics(cfg, metrics, default_name="eval.jsonl",
                                 version_key="eval/weight_version/max")
    return {"out": cfg.out, "rows": manifest["num_rows"], "step": cfg.step, "metrics": metrics,
            "metrics_path": str(metrics_path), "engines": router_stats["engines"]}
