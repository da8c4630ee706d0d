"""HF <-> megatron-core name and layout map for llama, qwen2, qwen3 and qwen3_moe.

A megatron "slot" is one global tensor of a torch_dist checkpoint: a sharded key plus its
prepended indices, `(key, (layer,))` or `(key, (layer, expert))`. Each slot is built from one to
three HF tensors and split back into them:

- `copy`: same tensor (norms, o_proj/linear_proj, down_proj/linear_fc2, router).
- `qkv`: fused per query group: for each of the `num_key_value_heads` groups, that group's query
  heads, then its key head, then its value head (rows of the [.., hidden] weight, or the bias).
  TP then splits whole groups.
- `fc1`: gate rows then up rows ([2 * ffn, hidden]); megatron's sharded state dict stores the two
  halves as separate chunks, so each TP rank holds the matching gate and up rows.
- `vocab`: embedding / output rows padded with zeros to the padded vocabulary (a multiple of
  128 * TP); the padding is dropped on the way back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rltool.convert.gpt_model import head_dim, hf_arch, num_experts
from rltool.errors import CheckpointError

if TYPE_CHECKING:
    import torch

Slot = tuple[str, tuple[int, ...]]

_L = "model.layers.{layer}."
_E = _L + "mlp.experts.{expert}."
# megatron sharded key -> (kind, HF name templates)
RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
    "decoder.final_layernorm.weight": ("copy", ("model.norm.weight",)),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight":
        ("copy", (_L + "input_layernorm.weight",)),
    "decoder.layers.self_attention.linear_qkv.weight":
        ("qkv", (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight",
                 _L + "self_attn.v_proj.weight")),
    "decoder.layers.self_attention.linear_qkv.bias":
        ("qkv", (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias",
                 _L + "self_attn.v_proj.bias")),
    "decoder.layers.self_attention.q_layernorm.weight": ("copy", (_L + "self_attn.q_norm.weight",)),
    "decoder.layers.self_attention.k_layernorm.weight": ("copy", (_L + "self_attn.k_norm.weight",)),
    "decoder.layers.self_attention.linear_proj.weight": ("copy", (_L + "self_attn.o_proj.weight",)),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight":
        ("copy", (_L + "post_attention_layernorm.weight",)),
    "decoder.layers.mlp.linear_fc1.weight":
        ("fc1", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight")),
    "decoder.layers.mlp.linear_fc2.weight": ("copy", (_L + "mlp.down_proj.weight",)),
    "decoder.layers.mlp.router.weight": ("copy", (_L + "mlp.gate.weight",)),
    "decoder.layers.mlp.experts.experts.linear_fc1.weight":
        ("fc1", (_E + "gate_proj.weight", _E + "up_proj.weight")),
    "decoder.layers.mlp.experts.experts.linear_fc2.weight": ("copy", (_E + "down_proj.weight",)),
}
# HF tensors that are derived state, not weights (old checkpoints store rotary buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Shapes:
    """The dimensions the layout functions need, read from an HF config."""

    hidden: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab: int

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> Shapes:
        return cls(hidden=hf_config["hidden_size"], num_heads=hf_config["num_attention_heads"],
                   num_groups=hf_config.get("num_key_value_heads")
                   or hf_config["num_attention_heads"],
                   head_dim=head_dim(hf_config), vocab=hf_config["vocab_size"])


def hf_names(key: str, index: tuple[int, ...], *, tied: bool = False) -> tuple[str, ...]:
    """The HF tensor names a slot is made of."""
    if key not in RULES:
        raise CheckpointError(f"megatron tensor {key} has no HF mapping")
    if key == "output_layer.weight" and tied:
        return ("model.embed_tokens.weight",)
    fields = dict(zip(("layer", "expert"), index, strict=False))
    return tuple(t.format(**fields) for t in RULES[key][1])


def expected_hf_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config must hold, with its shape."""
    arch = hf_arch(hf_config)
    s = Shapes.from_hf(hf_config)
    h, q_rows, kv_rows = s.hidden, s.num_heads * s.head_dim, s.num_groups * s.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, h),
                                       "model.norm.weight": (h,)}
    if not hf_config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (s.vocab, h)
    experts = num_experts(hf_config)
    bias = arch == "qwen2" or bool(hf_config.get("attention_bias"))
    for layer in range(hf_config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q_rows, h),
                    p + "self_attn.k_proj.weight": (kv_rows, h),
                    p + "self_attn.v_proj.weight": (kv_rows, h),
                    p + "self_attn.o_proj.weight": (h, q_rows)})
        if bias:
            out.update({p + "self_attn.q_proj.bias": (q_rows,),
                        p + "self_attn.k_proj.bias": (kv_rows,),
                        p + "self_attn.v_proj.bias": (kv_rows,)})
        if arch in ("qwen3", "qwen3_moe"):
            out.update({p + "self_attn.q_norm.weight": (s.head_dim,),
                        p + "self_attn.k_norm.weight": (s.head_dim,)})
        if experts:
            ffn = hf_config["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = (experts, h)
            for e in range(experts):
                pe = f"{p}mlp.experts.{e}."
                out.update({pe + "gate_proj.weight": (ffn, h), pe + "up_proj.weight": (ffn, h),
                            pe + "down_proj.weight": (h, ffn)})
        else:
            ffn = hf_config["intermediate_size"]
            out.update({p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                        p + "mlp.down_proj.weight": (h, ffn)})
    return out


def check_hf_tensors(found: dict[str, tuple[int, ...]], hf_config: dict[str, Any]) -> None:
    """Refuse a checkpoint whose tensors are missing, mis-shaped or unknown, naming the first few."""
    expected = expected_hf_shapes(hf_config)
    missing = sorted(set(expected) - set(found))
    extra = sorted(n for n in set(found) - set(expected)
                   if not n.endswith(IGNORED_SUFFIXES)
                   and not (n == "lm_head.weight" and hf_config.get("tie_word_embeddings")))
    wrong = sorted(f"{n} is {list(found[n])}, expected {list(shape)}"
                   for n, shape in expected.items() if n in found and tuple(found[n]) != shape)
    problems = [f"missing {n}" for n in missing] + wrong + [f"unexpected {n}" for n in extra]
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise CheckpointError("checkpoint does not match its config.json: "
                              + "; ".join(problems[:4]) + more)


def to_megatron(kind: str, tensors: list[torch.Tensor], *, shapes: Shapes,
                padded_vocab: int) -> torch.Tensor:
    """Build one global megatron tensor from its HF tensors."""
    import torch

    if kind == "copy":
        return tensors[0]
    if kind == "fc1":
        return torch.cat(tensors, dim=0)
    if kind == "vocab":
        w = tensors[0]
        if padded_vocab == w.shape[0]:
            return w
        out = w.new_zeros((padded_vocab, *w.shape[1:]))
        out[: w.shape[0]] = w
        return out
    if kind == "qkv":
        g = shapes.num_groups
        q, k, v = (t.reshape(g, -1, *t.shape[1:]) for t in tensors)
        fused = torch.cat([q, k, v], dim=1)
        return fused.reshape(-1, *fused.shape[2:])
    raise CheckpointError(f"internal: unknown layout kind {kind!r}")


def to_hf(kind: str, tensor: torch.Tensor, *, shapes: Shapes) -> list[torch.Tensor]:
    """Split one global megatron tensor back into its HF tensors (exact inverse of to_megatron)."""
    if kind == "copy":
        return [tensor]
    if kind == "fc1":
        return [t.contiguous() for t in tensor.chunk(2, dim=0)]
    if kind == "vocab":
        return [tensor[: shapes.vocab].contiguous()]
    if kind == "qkv":
        g, per_group = shapes.num_groups, shapes.num_heads // shapes.num_groups
        grouped = tensor.reshape(g, -1, *tensor.shape[1:])
        d = shapes.head_dim
        q, k, v = grouped.split([per_group * d, d, d], dim=1)
        return [t.reshape(-1, *t.shape[2:]).contiguous() for t in (q, k, v)]
    raise CheckpointError(f"internal: unknown layout kind {kind!r}")
