"""The shape of a model, read from its HF `config.json`: what the cost models need and nothing
more (parameter counts by class, attention and linear-attention layers, MoE experts)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltool.errors import BadInputError


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    attention_layers: int
    linear_layers: int
    # MoE (0 experts = dense)
    experts: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    dense_mlp_layers: int = 0  # MoE models: leading layers with a dense MLP
    # linear attention (Qwen3-Next-style gated delta rule)
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0
    mla: bool = False

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h

    def linear_attention_params(self) -> int:
        h = self.hidden
        k, v = self.lin_k_heads * self.lin_k_dim, self.lin_v_heads * self.lin_v_dim
        return h * (2 * k + 2 * v) + 2 * h * self.lin_v_heads + v * h \
            + self.conv_dim * self.conv_kernel

    def params(self) -> dict[str, int]:
        """Parameters by class: `dense` (embeddings, attention, dense MLPs, routers, shared
        experts) and `expert` (routed experts). Norms and biases are left out (< 0.1%)."""
        h = self.hidden
        embed = self.vocab * h * (1 if self.tied else 2)
        mixers = self.attention_layers * self.attention_params() \
            + self.linear_layers * self.linear_attention_params()
        if self.experts:
            moe_layers = self.layers - self.dense_mlp_layers
            dense_mlp = self.dense_mlp_layers * 3 * h * self.intermediate
            router_shared = moe_layers * (h * self.experts + 3 * h * self.shared_intermediate)
            expert = moe_layers * self.experts * 3 * h * self.expert_intermediate
            return {"dense": embed + mixers + dense_mlp + router_shared, "expert": expert}
        return {"dense": embed + mixers + self.layers * 3 * h * self.intermediate, "expert": 0}


def _int(cfg: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if default is None:
        raise BadInputError(f"model config has none of {', '.join(keys)}; pass an HF config.json")
    return default


def shape_from_config(cfg: dict[str, Any]) -> ModelShape:
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    hidden = _int(cfg, "hidden_size", "d_model")
    layers = _int(cfg, "num_hidden_layers", "num_layers", "n_layer")
    heads = _int(cfg, "num_attention_heads", "n_head")
    kv_heads = _int(cfg, "num_key_value_heads", default=heads)
    head_dim = _int(cfg, "head_dim", default=hidden // heads)
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        linear = sum(1 for t in types if t in ("linear_attention", "mamba", "ssm"))
    elif isinstance(cfg.get("full_attention_interval"), int):
        linear = layers - layers // cfg["full_attention_interval"]
    else:
        linear = 0
    experts = _int(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    inter = _int(cfg, "intermediate_size", "ffn_hidden_size", default=4 * hidden)
    expert_inter = _int(cfg, "moe_intermediate_size", default=inter) if experts else 0
    shared = _int(cfg, "shared_expert_intermediate_size", default=0)
    if experts and not shared:
        shared = _int(cfg, "n_shared_experts", default=0) * expert_inter
    return ModelShape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=inter, vocab=_int(cfg, "vocab_size"),
        tied=bool(cfg.get("tie_word_embeddings", False)), attention_layers=layers - linear,
        linear_layers=linear, experts=experts, expert_intermediate=expert_inter,
        shared_intermediate=shared,
        dense_mlp_layers=_int(cfg, "first_k_dense_replace", default=0) if experts else 0,
        lin_k_heads=_int(cfg, "linear_num_key_heads", default=0),
        lin_v_heads=_int(cfg, "linear_num_value_heads", default=0),
        lin_k_dim=_int(cfg, "linear_key_head_dim", default=0),
        lin_v_dim=_int(cfg, "linear_value_head_dim", default=0),
        conv_kernel=_int(cfg, "linear_conv_kernel_dim", default=0),
        mla="kv_lora_rank" in cfg or "index_topk" in cfg)


def load_shape(path: str | Path) -> ModelShape:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInputError(f"--model {path}: no such file; pass a model's config.json") from None
    except json.JSONDecodeError as e:
        raise BadInputError(f"--model {path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise BadInputError(f"--model {path} is not a JSON object")
    shape = shape_from_config(cfg)
    if shape.linear_layers and not (shape.lin_v_heads and shape.lin_k_dim and shape.lin_v_dim):
        raise BadInputError(f"--model {path}: linear-attention layers without "
                            "linear_num_value_heads, linear_key_head_dim and "
                            "linear_value_head_dim")
    return shape
