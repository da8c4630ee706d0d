"""Model provider: a megatron-core GPTModel (local layer spec) built from an HF config.

Shared by `rltool convert` and the megatron trainer. Supported HF architectures: llama, qwen2,
qwen3 and qwen3_moe (RMSNorm, SwiGLU, RoPE; qwen2's q/k/v biases, qwen3's q/k norms, qwen3_moe's
top-k softmax routers). The local spec (no transformer-engine) keeps norms as separate modules;
their checkpoint keys are the TE-fused names (`linear_qkv.layer_norm_weight`, ...), so torch_dist
checkpoints load into TE models too. megatron.core is imported inside functions only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rltool.errors import CheckpointError

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default; times TP


def hf_arch(hf_config: dict[str, Any]) -> str:
    arch = hf_config.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"model_type {arch!r} is not supported; rltool converts "
                              f"{', '.join(SUPPORTED_ARCHS)}")
    return arch


def padded_vocab_size(vocab_size: int, *, tp: int, divisible_by: int = VOCAB_MULTIPLE) -> int:
    """Megatron pads the vocabulary to a multiple of divisible_by * TP (equal TP shards)."""
    multiple = divisible_by * tp
    return math.ceil(vocab_size / multiple) * multiple


def head_dim(hf_config: dict[str, Any]) -> int:
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]


def num_experts(hf_config: dict[str, Any]) -> int | None:
    return hf_config.get("num_experts") or hf_config.get("num_local_experts")


def _rope_theta(hf_config: dict[str, Any]) -> float:
    rope = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise CheckpointError(f"rope_type {kind!r} is not supported by the converter (default only)")
    return float(rope.get("rope_theta") or hf_config.get("rope_theta") or 10000.0)


def transformer_config(hf_config: dict[str, Any], *, tp: int = 1, pp: int = 1, ep: int = 1,
                       params_dtype: torch.dtype | None = None, **overrides: Any) -> Any:
    """megatron-core TransformerConfig equivalent to `hf_config` (a config.json dict).

    `overrides` go to TransformerConfig last (e.g. recompute or dropout settings of a trainer).
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    arch = hf_arch(hf_config)
    if hf_config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {hf_config['hidden_act']!r} is not supported (silu only)")
    dtype = params_dtype or torch.float32
    kwargs: dict[str, Any] = dict(
        num_layers=hf_config["num_hidden_layers"], hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=hf_config["num_attention_heads"],
        num_query_groups=hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"],
        kv_channels=head_dim(hf_config), normalization="RMSNorm",
        layernorm_epsilon=hf_config.get("rms_norm_eps", 1e-6), gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=arch == "qwen2" or bool(hf_config.get("attention_bias")),
        qk_layernorm=arch in ("qwen3", "qwen3_moe"), hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, pipeline_dtype=dtype, use_cpu_initialization=True,
        perform_initialization=True, init_method_std=hf_config.get("initializer_range", 0.02),
        # fused kernels are CUDA-only; the unfused paths compute the same function
        apply_rope_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    experts = num_experts(hf_config)
    if experts:
        if hf_config.get("decoder_sparse_step", 1) != 1 or hf_config.get("mlp_only_layers"):
            raise CheckpointError("MoE models with dense layers (decoder_sparse_step != 1 or "
                                  "mlp_only_layers) are not supported")
        kwargs.update(
            num_moe_experts=experts, moe_router_topk=hf_config["num_experts_per_tok"],
            moe_ffn_hidden_size=hf_config["moe_intermediate_size"],
            # Megatron: top-k of the logits then softmax over them == HF softmax, top-k and
            # renormalize (norm_topk_prob); softmax first without renormalizing otherwise.
            moe_router_pre_softmax=not hf_config.get("norm_topk_prob", False),
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=hf_config.get("router_aux_loss_coef", 0.0),
            # alltoall is the GPU choice; it needs CUDA streams, allgather routes on CPU
            moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
            moe_grouped_gemm=False,
            moe_router_dtype="fp32")
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(hf_config: dict[str, Any], *, tp: int = 1, pp: int = 1, ep: int = 1,
                    params_dtype: torch.dtype | None = None, vocab_size: int | None = None,
                    perform_initialization: bool = True, pre_process: bool | None = None,
                    post_process: bool | None = None, core_attention: type | None = None,
                    **config_overrides: Any) -> Any:
    """Build this rank's megatron-core GPTModel (local spec) for an HF config.json dict.

    Model-parallel state must be initialized with the same tp/pp/ep
    (`rltool.megatron_compat.init_distributed`). `vocab_size` is the padded vocabulary (default:
    HF's vocab padded to a multiple of 128 * tp). `perform_initialization=False` leaves weights
    uninitialized, for callers that load them next (conversion, checkpoint resume).
    `core_attention` replaces the local spec's `DotProductAttention` (same constructor and forward).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if (parallel_state.get_tensor_model_parallel_world_size() != tp
            or parallel_state.get_pipeline_model_parallel_world_size() != pp
            or parallel_state.get_expert_model_parallel_world_size() != ep):
        raise CheckpointError(f"model-parallel state does not match tp={tp} pp={pp} ep={ep}; "
                              "call megatron_compat.init_distributed with the same sizes")
    config = transformer_config(hf_config, tp=tp, pp=pp, ep=ep, params_dtype=params_dtype,
                                perform_initialization=perform_initialization, **config_overrides)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    if core_attention is not None:
        spec.submodules.self_attention.submodules.core_attention = core_attention
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config, transformer_layer_spec=spec,
        vocab_size=vocab_size or padded_vocab_size(hf_config["vocab_size"], tp=tp),
        max_sequence_length=hf_config.get("max_position_embeddings", 4096),
        pre_process=pre_process, post_process=post_process, position_embedding_type="rope",
        rotary_base=_rope_theta(hf_config),
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)))
    return model
