"""What the engine's model is: the architecture and sizes read from a HF checkpoint's config.json,
refused up front (one-line CheckpointError) for anything the model does not implement."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rltool.engine import moe
from rltool.engine.linear_attention import LinearSpec, read_linear_spec
from rltool.engine.rope import RopeScaling, read_rope_scaling
from rltool.errors import CheckpointError

ARCHS = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
         "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen3_5ForCausalLM": "qwen3_5"}
# For a config.json without "architectures":
MODEL_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama", "qwen3_moe": "qwen3_moe",
               "qwen3_5_text": "qwen3_5"}
# Hybrid linear-attention families the engine's model does not implement (yet), and why.
UNSUPPORTED = {"Qwen3NextForCausalLM": "qwen3_next (GDN projections interleaved per key-head "
                                       "group; MoE layers with a gated shared expert)",
               "Qwen3_5MoeForCausalLM": "qwen3_5_moe (MoE layers with a gated shared expert)",
               "KimiLinearForCausalLM": "kimi_linear (Kimi Delta Attention: a decay per key "
                                        "channel; MLA attention layers)"}


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int  # positions served: config.json's, extended by RoPE scaling
    rope: RopeScaling = RopeScaling()
    moe: moe.MoeSpec | None = None  # qwen3_moe: the sparse layers' MLP
    linear: LinearSpec | None = None  # qwen3_5: the Gated DeltaNet layers (a hybrid model)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers with attention KV (every layer but a hybrid's GDN layers)."""
        gdn = set(self.linear.linear_layers) if self.linear is not None else set()
        return tuple(i for i in range(self.num_layers) if i not in gdn)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token per element byte (times 2 for bf16)."""
        return 2 * len(self.kv_layers) * self.num_kv_heads * self.head_dim


def read_spec(model_dir: str | Path) -> ModelSpec:
    """The spec of a HF checkpoint; a one-line CheckpointError for anything not supported."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    archs = cfg.get("architectures") or []
    arch = ARCHS.get(archs[0]) if archs else MODEL_TYPES.get(cfg.get("model_type"))
    if archs and archs[0] in UNSUPPORTED:
        raise CheckpointError(f"{path}: {UNSUPPORTED[archs[0]]} is not supported by the engine's "
                              "model (its dense-MLP hybrid qwen3_5 is); serve it with "
                              "--engine sglang")
    if arch is None:
        raise CheckpointError(f"{path}: architecture {archs or cfg.get('model_type')!r} is not "
                              f"supported by the engine's model; supported: {', '.join(ARCHS)} "
                              "(serve others with --engine sglang)")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    scaling = read_rope_scaling(cfg, where=str(path))
    if arch == "qwen3_5" and scaling.rope_type != "default":
        raise CheckpointError(f"{path}: rope scaling {scaling.rope_type!r} is not supported for "
                              "the hybrid qwen3_5 (dense families only); serve it with "
                              "--engine sglang")
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    if arch == "llama" and cfg.get("mlp_bias"):
        raise CheckpointError(f"{path}: llama with mlp_bias is not supported by the engine's model")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported "
                              "(silu only)")
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
    if arch == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = bool(cfg.get("attention_bias", False))
    return ModelSpec(
        arch=arch, hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim), vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        qkv_bias=qkv_bias, qk_norm=arch in ("qwen3", "qwen3_moe", "qwen3_5"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=scaling.context_length(int(cfg.get("max_position_embeddings",
                                                                   2048))),
        rope=scaling,
        moe=(moe.read_moe_spec(cfg, int(cfg["num_hidden_layers"]), where=str(path))
             if arch == "qwen3_moe" else None),
        linear=(read_linear_spec(cfg, head_dim=int(head_dim), where=str(path))
                if arch == "qwen3_5" else None))
