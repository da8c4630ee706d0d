"""The eval stage: every prompt of a held-out file, K samples each -> eval shard + pass@k metrics.

`run(cfg)` is the library entry (the loop calls it every few steps); `rltool eval` is its command.
Eval never feeds training: its shard goes to `--out` (the loop uses RUN/eval/step-K/) and its
metrics to `eval.jsonl` (next to `--out` unless `--metrics`). There is no filtering, no
over-sampling and no carry-over; every prompt of the file (or the first `--max-prompts`) is
sampled once as a group of `--n-samples-per-prompt`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rltool.rollout.collect import check_generation
from rltool.rollout.stage import EngineStageConfig, StageInputs, with_seed, write_metrics

PRODUCER = "rltool eval"
CONFIG_NAME = "eval_config.toml"


class EvalConfig(EngineStageConfig):
    """`rltool eval`: evaluation shards and pass@k metrics on held-out prompts."""

    max_prompts: int | None = Field(None, ge=1, description="Evaluate only the first N prompts "
                                    "of the file (default: all).")
    pass_threshold: float = Field(1.0, description="A sample passes (for pass@1 / pass@k) when "
                                  "its reward is at least this.")


def run(cfg: EvalConfig, *, clients: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate; returns {out, rows, metrics, metrics_path, engines}. `clients` as for
    rltool.rollout.stage.run."""
    from rltool.rollout.metrics import eval_metrics

    cfg = with_seed(cfg)
    inputs = StageInputs(cfg, clients=clients)
    num_prompts = min(cfg.max_prompts or len(inputs.prompts), len(inputs.prompts))
    source = (inputs.new_group(p, n=cfg.n_samples_per_prompt, uid_prefix=f"eval{cfg.step:06d}")
              for p in range(num_prompts))
    result, router_stats = inputs.collect(cfg, source, target_groups=num_prompts, label="eval")
    check_generation(result.kept, step=cfg.step)
    meta = inputs.shard_meta(cfg, producer=PRODUCER, extra={"pass_threshold": cfg.pass_threshold})
    manifest = inputs.write(cfg, result.kept, meta=meta, config_name=CONFIG_NAME)
    metrics = eval_metrics(result.kept, pass_threshold=cfg.pass_threshold,
                           elapsed_s=result.elapsed_s, output_tokens=result.output_tokens)
    versions = [v for g in result.kept for s in g for v in s.weight_versions if v >= 0]
    metrics["eval/weight_version/max"] = max(versions, default=-1)
    metrics_path = write_metrics(cfg, metrics, default_name="eval.jsonl",
                                 version_key="eval/weight_version/max")
    return {"out": cfg.out, "rows": manifest["num_rows"], "step": cfg.step, "metrics": metrics,
            "metrics_path": str(metrics_path), "engines": router_stats["engines"]}
