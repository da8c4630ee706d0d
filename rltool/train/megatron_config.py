"""The megatron trainer's options, with Megatron-LM's flag names (`--tensor-model-parallel-size`,
...). `BackendConfig` extends this class, so every trainer config carries them; the torch backend
ignores them and the train config refuses them with `backend = "torch"`. (Activation
recomputation, which both backends take, is `BackendConfig.recompute`.)"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rltool.config import StageConfig


class MegatronOptions(StageConfig):
    """Parallel layout and memory knobs of `backend = "megatron"` (docs/train.md)."""

    backend: Literal["torch", "megatron"] = Field(
        "torch", description="Trainer backend: torch (transformers + DDP/FSDP2) or megatron "
        "(megatron-core GPTModel with TP/PP/EP, packed sequences; launch with --nproc-per-node).")
    tensor_model_parallel_size: int = Field(1, ge=1, description="megatron: tensor-parallel size.")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="megatron: pipeline-parallel "
                                              "size.")
    context_parallel_size: int = Field(1, ge=1, description="megatron: context-parallel size "
                                       "(needs transformer-engine attention).")
    expert_model_parallel_size: int = Field(1, ge=1, description="megatron: expert-parallel size "
                                            "(MoE).")
    expert_tensor_parallel_size: int | None = Field(None, ge=1, description="megatron: tensor-"
                                                    "parallel size inside experts (default: "
                                                    "--tensor-model-parallel-size).")
    sequence_parallel: bool = Field(False, description="megatron: shard activations outside "
                                    "attention/MLP along the sequence over the TP ranks.")
    use_distributed_optimizer: bool = Field(False, description="megatron: shard optimizer state "
                                            "and fp32 master weights over data-parallel "
                                            "ranks.")
    optimizer_offload_fraction: float = Field(
        1.0, ge=0.0, le=1.0, description="megatron, with --optimizer-cpu-offload: the share of "
        "the optimizer state (masters, moments) held and stepped on the host.")
    transformer_impl: Literal["local", "transformer_engine"] = Field(
        "local", description="megatron: layer spec; local uses rltool's SDPA core attention, "
        "transformer_engine needs TE installed (untested here).")

    def megatron_options_set(self) -> list[str]:
        """The megatron-only options this config sets away from their defaults (flag names)."""
        return [f"--{name.replace('_', '-')}" for name, field in MegatronOptions.model_fields.items()
                if name != "backend" and getattr(self, name) != field.default]
