"""Megatron-LM's checkpoint directory layout and the training arguments it reads from `common.pt`.

Megatron-LM (and slime's `train.py --load`, which runs its loader) opens a checkpoint root through
`latest_checkpointed_iteration.txt`: the tracker must hold `release` (a conversion: directory
`release/`) or an integer iteration > 0 (a training save: `iter_NNNNNNN/`, 7 digits). Anything else,
0 included, stops the run. Its loader also reads `args` from the common state and compares the
model-shape arguments with the run's own; `checkpoint_args` records them for a converted model.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from rltool.convert.gpt_model import head_dim, hf_arch, num_experts
from rltool.errors import CheckpointError

log = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"  # the tracker text and directory name of a converted (not trained) checkpoint
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version, kept in the common state
LEGACY_ITERATION = 0  # older rltool conversions: iter_0000000 with tracker 0 (Megatron-LM refuses)


def iteration_dir_name(iteration: int) -> str:
    """`iter_NNNNNNN` for a training save; Megatron-LM reads only iterations >= 1 back."""
    if iteration < 1:
        raise CheckpointError(f"iteration {iteration} cannot be saved in Megatron-LM's layout "
                              "(its loader accepts iterations >= 1 or `release`)")
    return f"iter_{iteration:07d}"


def resolve_root(root: Path) -> Path:
    """The checkpoint directory a root's tracker names: `release/`, `iter_NNNNNNN/` (>= 1), or an
    older rltool conversion's `iter_0000000/` (read, with a one-line notice)."""
    text = (root / TRACKER_FILE).read_text().strip()
    if text == RELEASE:
        return root / RELEASE
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration >= 1:
        return root / iteration_dir_name(iteration)
    legacy = root / f"iter_{LEGACY_ITERATION:07d}"
    if iteration == LEGACY_ITERATION and legacy.is_dir():
        log.warning("%s is an older rltool conversion (iter_0000000, tracker 0): rltool reads it, "
                    "Megatron-LM does not; convert again for the release/ layout", root)
        return legacy
    raise CheckpointError(f"{root / TRACKER_FILE} holds {text[:40]!r}; a Megatron-LM tracker holds "
                          "`release` or an iteration >= 1")


def checkpoint_args(hf_config: dict[str, Any], *, tp: int, pp: int, ep: int, padded_vocab: int,
                    divisible_by: int) -> argparse.Namespace:
    """The `args` namespace Megatron-LM keeps in a checkpoint, for an HF model converted at
    tp/pp/ep: the model-shape arguments its loader compares with the run's (plain values only,
    so `torch.load(weights_only=True)` reads it). docs/formats.md lists each field."""
    arch = hf_arch(hf_config)
    heads = hf_config["num_attention_heads"]
    groups = hf_config.get("num_key_value_heads") or heads
    experts = num_experts(hf_config)
    rope = hf_config.get("rope_parameters") or {}
    values: dict[str, Any] = dict(
        num_layers=hf_config["num_hidden_layers"], hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"], num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups,
        kv_channels=head_dim(hf_config),
        max_position_embeddings=hf_config.get("max_position_embeddings"),
        vocab_size=hf_config["vocab_size"], padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=divisible_by,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        # Megatron-LM's default; with rope it is ignored (position_embedding_type decides), and a
        # run that does not pass --no-position-embedding compares True against it
        add_position_embedding=True, position_embedding_type="rope",
        use_rotary_position_embeddings=True,
        rotary_base=float(rope.get("rope_theta") or hf_config.get("rope_theta") or 10000.0),
        rotary_percent=1.0, normalization="RMSNorm",
        norm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)), swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=arch == "qwen2" or bool(hf_config.get("attention_bias")),
        qk_layernorm=arch in ("qwen3", "qwen3_moe"),
        untie_embeddings_and_output_weights=not hf_config.get("tie_word_embeddings", False),
        num_experts=experts,
        moe_router_topk=hf_config.get("num_experts_per_tok") if experts else None,
        moe_ffn_hidden_size=hf_config.get("moe_intermediate_size") if experts else None,
        tokenizer_type="HuggingFaceTokenizer", data_parallel_random_init=False,
        ckpt_format="torch_dist", iteration=0, consumed_train_samples=0,
        consumed_valid_samples=0,
        # nothing but the model is saved: loaders skip the optimizer and RNG state
        no_save_optim=True, no_save_rng=True)
    return argparse.Namespace(**values)
