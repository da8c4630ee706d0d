"""Megatron-LM's rules for opening a checkpoint root, as reference data, and a checker over them.

Written from Megatron-LM's loader (megatron/training/checkpointing.py) and its argument parser,
independently of rltool's writer: the tracker file holds `release` or an integer iteration > 0
(anything else stops the run); the directory is `release/` or `iter_` + the iteration in 7 digits;
the common state holds `checkpoint_version`, `iteration` and the run's `args`, whose model-shape
arguments must equal the loading run's (check_checkpoint_args asserts equality; with
--use-checkpoint-args the run takes them from the checkpoint instead).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
COMMON_KEYS = ("checkpoint_version", "iteration", "args")
MIN_CHECKPOINT_VERSION = 3.0  # below it Megatron-LM compares the old `model_parallel_size`
# compared by check_checkpoint_args (add_position_embedding against its default True; the vocabulary
# ones when the run passes a vocab file) and read back by --use-checkpoint-args
COMPARED_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding",
                 "max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size",
                 "tokenizer_type", "data_parallel_random_init", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size")
CHECKPOINT_ARGS = ("ffn_hidden_size", "num_query_groups", "group_query_attention", "kv_channels",
                   "position_embedding_type", "use_rotary_position_embeddings", "rotary_base",
                   "rotary_percent", "normalization", "norm_epsilon", "swiglu", "add_bias_linear",
                   "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights",
                   "vocab_size", "expert_model_parallel_size", "num_experts", "moe_router_topk")


def slime_run_args(hf_dir: Path, *, tp: int, pp: int, ep: int) -> dict:
    """What a slime model script passes for this HF model (scripts/models/*.sh style), plus
    Megatron-LM's defaults for what it leaves out."""
    c = json.loads((Path(hf_dir) / "config.json").read_text())
    arch, heads = c["model_type"], c["num_attention_heads"]
    groups = c.get("num_key_value_heads") or heads
    experts = c.get("num_experts") or c.get("num_local_experts")  # qwen3_moe's, transformers 5's
    rope = c.get("rope_parameters") or c  # transformers 5 nests rope_theta
    multiple = 128 * tp
    return dict(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
        num_attention_heads=heads, add_position_embedding=True,
        max_position_embeddings=c["max_position_embeddings"], make_vocab_size_divisible_by=128,
        padded_vocab_size=-(-c["vocab_size"] // multiple) * multiple,
        tokenizer_type="HuggingFaceTokenizer", data_parallel_random_init=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        ffn_hidden_size=c["intermediate_size"], num_query_groups=groups,
        group_query_attention=groups != heads,
        kv_channels=c.get("head_dim") or c["hidden_size"] // heads,
        position_embedding_type="rope", use_rotary_position_embeddings=True,
        rotary_base=float(rope.get("rope_theta", 10000.0)), rotary_percent=1.0,
        normalization="RMSNorm", norm_epsilon=float(c["rms_norm_eps"]), swiglu=True,
        add_bias_linear=False, add_qkv_bias=arch == "qwen2",
        qk_layernorm=arch in ("qwen3", "qwen3_moe"),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        vocab_size=c["vocab_size"], expert_model_parallel_size=ep, num_experts=experts,
        moe_router_topk=c.get("num_experts_per_tok") if experts else None)


def load_problems(root: Path, run_args: dict) -> list[str]:
    """Why Megatron-LM's loader would refuse `root` for a run with `run_args` ([] when it loads)."""
    import torch

    tracker = Path(root) / TRACKER_FILE
    if not tracker.is_file():
        return [f"no {TRACKER_FILE}"]
    text = tracker.read_text().strip()
    if text == RELEASE:
        directory = Path(root) / RELEASE
    elif text.isdigit() and int(text) > 0:
        directory = Path(root) / f"iter_{int(text):07d}"
    else:
        return [f"tracker holds {text!r}: neither an iteration > 0 nor {RELEASE!r}"]
    if not (directory / ".metadata").is_file() or not (directory / "common.pt").is_file():
        return [f"{directory.name}/ is not a torch_dist checkpoint"]
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(directory / "common.pt", map_location="cpu", weights_only=True)
    problems = [f"common.pt lacks {k}" for k in COMMON_KEYS if k not in common]
    if problems:
        return problems
    if common["checkpoint_version"] < MIN_CHECKPOINT_VERSION:
        problems.append(f"checkpoint_version {common['checkpoint_version']}")
    if text != RELEASE and common["iteration"] != int(text):
        problems.append(f"iteration {common['iteration']} under tracker {text}")
    args = common["args"]
    for name in COMPARED_ARGS + CHECKPOINT_ARGS:
        if not hasattr(args, name):
            problems.append(f"args lacks {name}")
        elif getattr(args, name) != run_args[name]:
            problems.append(f"args.{name} = {getattr(args, name)!r}, "
                            f"the run has {run_args[name]!r}")
    return problems
