"""`rltool align-gate` configuration: one strict pydantic model (flags, or `[align]` in a TOML)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rltool.config import ComputeDtype, StageConfig, checked_urls, cli

DEFAULT_TOL = 1e-6


class AlignGateConfig(StageConfig):
    """What to compare (shards vs weights), how the trainer recomputes, and the tolerance.

    The recompute knobs (dtype, deterministic, max_tokens_per_microbatch, global_batch_size) mean
    what they mean for `rltool train`: pass the values the training run uses, so the gate measures
    the logprobs training really sees.
    """

    rollouts: list[str] = Field(description="Rollout shard directories.",
                                json_schema_extra=cli(metavar="DIR[,DIR...]"))
    weights: str = Field(description="Weights the rollouts were sampled with: a HF weights dir "
                         "(weight_vNNNNNN) or a trainer checkpoint step-NNNNNN.")
    backend: Literal["torch", "megatron"] = Field(
        "torch", description="Trainer backend that recomputes the logprobs (megatron: one process, "
        "TP1, the local spec's SDPA attention).")
    tol: float = Field(DEFAULT_TOL, ge=0.0, description="Gate: pass when "
                       "train_rollout_logprob_abs_diff <= tol.")
    allow_version_mismatch: bool = Field(False, description="Compare even when the weights "
                                         "declare a version other than the shards' tokens.")
    dtype: ComputeDtype = Field("fp32", description="Trainer compute dtype (as "
                                           "`rltool train --dtype`).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "cpu", description="Where the trainer path recomputes: exact alignment needs the "
        "engine's device on both sides. auto: the device and dtype the shards record for their "
        "engines (an explicit --dtype wins); without a record, CUDA when available.")
    deterministic: bool = Field(False, description="Trainer's deterministic layout: one unpadded "
                                "forward per sample (as `rltool train --deterministic`).")
    max_tokens_per_microbatch: int = Field(4096, ge=1, description="Trainer micro-batch token cap "
                                           "(as `rltool train`).")
    global_batch_size: int | None = Field(None, ge=1, description="Samples per optimizer step of "
                                          "the training run (default: all samples).")
    num_worst: int = Field(5, ge=0, description="Worst samples and worst token positions to "
                           "report.")
    layerwise: bool = Field(False, description="Also compare per-layer hidden states of the worst "
                            "samples between the engine (--engine) and the trainer model.")
    engine: str | None = Field(None, description="Engine URL for --layerwise (serving the same "
                               "weights, started with --enable-debug-endpoints).")
    layerwise_samples: int = Field(1, ge=1, description="How many of the worst samples "
                                   "--layerwise compares.")
    layer_tol: float | None = Field(None, ge=0.0, description="Per-layer max |diff| tolerance "
                                    "for --layerwise (default: --tol).")
    api_key: str | None = Field(None, description="Bearer token for --engine.",
                                 json_schema_extra=cli(envvar="RLTOOL_API_KEY"))
    timeout_s: float = Field(120.0, gt=0, description="Timeout of one engine debug request.")
    report: str | None = Field(None, description="Also write the result as JSON to this file "
                               "(and the resolved config next to it).")

    @field_validator("engine")
    @classmethod
    def _check_engine(cls, value: str | None) -> str | None:
        return checked_urls(value)

    @field_validator("rollouts", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            return [d.strip() for item in value for d in str(item).split(",") if d.strip()]
        return value

    @model_validator(mode="after")
    def _check(self) -> "AlignGateConfig":
        if not self.rollouts:
            raise ValueError("--rollouts: give at least one shard directory")
        if self.layerwise and not self.engine:
            raise ValueError("--layerwise needs --engine URL (an engine serving the same weights "
                             "with --enable-debug-endpoints)")
        return self

    @property
    def effective_layer_tol(self) -> float:
        return self.tol if self.layer_tol is None else self.layer_tol
