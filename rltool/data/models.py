"""Tiny random-init HF causal LMs for tests, CI and the demo (no hub access).

`init_model` writes config.json + model.safetensors + the character tokenizer + chat template +
`rltool_version.json` ({"version": 0}), published atomically. The weights are drawn on the CPU or,
for the large presets, on a GPU (seconds instead of minutes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from rltool import atomic
from rltool.config import DTYPE_ALIASES, ComputeDtype, StageConfig, torch_dtype_name
from rltool.errors import BadInputError
from rltool.rundir import VERSION_FILE

ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen3_5")
# Hybrid linear-attention families transformers has but the engine's model does not implement
# (docs/serve.md, "Hybrid models"): refused by name, with the reason.
REFUSED_ARCHS = {
    "qwen3_next": "its Gated DeltaNet projections (in_proj_qkvz, in_proj_ba) interleave q, k, v "
                  "and z per key-head group, and its MoE layers add a sigmoid-gated shared "
                  "expert; the engine's model implements neither",
    "qwen3_5_moe": "its MoE layers add a sigmoid-gated shared expert, which the engine's model "
                   "does not implement",
    "kimi_linear": "Kimi Delta Attention decays each key channel (not each head) through "
                   "low-rank gates and its attention layers are MLA; the engine's model "
                   "implements neither",
}
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.1M parameters: every test and the CPU demo use this.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512),
    # tiny's widths in 4 layers: with --arch qwen3_5, 3 Gated DeltaNet layers and 1 attention layer.
    "tiny-4l": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    # A few M parameters: for benchmarks that need more work per token.
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048),
    # Qwen2.5-0.5B's shapes (~0.5B parameters, ~1 GB in bf16), for throughput benchmarks.
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, vocab_size=151936),
    # A hybrid for GPU benchmarks with --arch qwen3_5 (~0.67B parameters, ~1.3 GB in bf16): 18
    # Gated DeltaNet layers (4 key heads, 8 value heads, key and value dims 128, as Qwen3-Next's
    # at half its width) and 6 attention layers, every fourth; Qwen2.5's vocabulary.
    "hybrid-0.7b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                        num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=32768, vocab_size=151936),
    # Qwen2.5-3B's and Qwen2.5-7B's shapes (untied heads), for GPU benchmarks.
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2,
                       max_position_embeddings=32768, vocab_size=151936),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, vocab_size=152064),
}


def check_preset(preset: str) -> None:
    """BadInputError naming the presets unless `preset` is one."""
    if preset not in PRESETS:
        raise BadInputError(f"unknown --preset {preset!r}; choose one of {', '.join(PRESETS)}")


def build_config(arch: str, preset: str, *, vocab_size: int, eos_token_id: int,
                 pad_token_id: int, fit_vocab: bool = False) -> Any:
    """The HF config of `preset`; its vocabulary is the preset's own unless `fit_vocab` (or the
    preset names none): then `vocab_size`, the tokenizer's."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if arch in REFUSED_ARCHS:
        raise BadInputError(f"--arch {arch} is not supported: {REFUSED_ARCHS[arch]}; the "
                            "dense-MLP hybrid is --arch qwen3_5")
    if arch not in ARCHS:
        raise BadInputError(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    check_preset(preset)
    shape = dict(PRESETS[preset])
    if fit_vocab:
        shape["vocab_size"] = vocab_size
    shape.setdefault("vocab_size", vocab_size)
    common = dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None,
                  initializer_range=0.02, torch_dtype="float32", **shape)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=shape["hidden_size"] // shape["num_attention_heads"], **common)
    if arch == "qwen3_moe":
        # Every layer sparse: 4 experts of half the dense width, top-2 with renormalized weights
        # (Qwen3-MoE's choice), so conversion and routing tests see real expert layers.
        return Qwen3MoeConfig(head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                              num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                              moe_intermediate_size=shape["intermediate_size"] // 2,
                              decoder_sparse_step=1, mlp_only_layers=[], **common)
    if arch == "qwen3_5":
        return _hybrid_config(shape, common)
    return LlamaConfig(**common)


def _hybrid_config(shape: dict[str, Any], common: dict[str, Any]) -> Any:
    """Qwen3.5's dense-MLP hybrid (HF model_type qwen3_5_text): Gated DeltaNet layers with a
    full-attention layer every fourth layer and last (a 2-layer preset: one of each). The linear
    layers take half the attention heads as key heads and all of them as value heads (so the
    key heads are shared, as in the released models), of the attention head size."""
    from transformers import Qwen3_5TextConfig

    layers, heads = shape["num_hidden_layers"], shape["num_attention_heads"]
    head_dim = shape["hidden_size"] // heads
    types = ["full_attention" if (i + 1) % 4 == 0 or i + 1 == layers else "linear_attention"
             for i in range(layers)]
    return Qwen3_5TextConfig(head_dim=head_dim, layer_types=types,
                             linear_num_key_heads=max(heads // 2, 1),
                             linear_num_value_heads=heads, linear_key_head_dim=head_dim,
                             linear_value_head_dim=head_dim, linear_conv_kernel_dim=4, **common)


# Weights drawn off the CPU are written in shards of at most this size: safetensors stages a
# shard in host memory on its way to the file, so the host never holds the whole model.
DEVICE_SHARD_SIZE = "4GB"


def init_model(out: str | os.PathLike, *, arch: str = "qwen2", preset: str = "tiny",
               task: str | None = None, seed: int = 0, dtype: str = "fp32",
               fit_vocab: bool = False, device: str = "cpu") -> Path:
    """Write a random-init checkpoint and tokenizer to `out` (refuses an existing directory);
    `fit_vocab`: the preset's shapes with the tokenizer's vocabulary (no unused embedding rows).

    `device` ("cpu", "cuda", "cuda:N"): where the weights are drawn, directly in `dtype` and with
    transformers' own init (same distributions). A seed gives the same weights on the same kind
    of device, not across devices; off the CPU the file is written in shards of at most
    DEVICE_SHARD_SIZE and the device's memory is released before returning.
    """
    import torch
    from transformers import AutoTokenizer

    from rltool.data.tasks import get_task
    from rltool.data.tokenizer import build_tokenizer

    out = Path(out)
    if out.exists():
        raise BadInputError(f"{out} already exists; choose a new --out directory")
    if task is not None:
        get_task(task)  # validates the name
    dtype = DTYPE_ALIASES.mapping.get(dtype, dtype)
    if dtype not in ("fp32", "bf16"):
        raise BadInputError(f"unknown --dtype {dtype!r}; choose fp32 or bf16")
    where = parse_device(device)
    with atomic.publish_dir(out, marker=VERSION_FILE, marker_content={"version": 0}) as tmp:
        build_tokenizer(tmp)
        tok = AutoTokenizer.from_pretrained(str(tmp))
        config = build_config(arch, preset, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, fit_vocab=fit_vocab)
        if task is not None:
            config.rltool_task = task
        _save_weights(tmp, config, tok, seed=seed, device=where,
                      dtype=getattr(torch, torch_dtype_name(dtype)))
    if where.type == "cuda":  # the model went with _save_weights' frame: hand its memory back
        torch.cuda.empty_cache()
    return out


def parse_device(device: str) -> Any:
    """`device` as a torch.device; one-line errors for a malformed or absent device (commands
    check it before they write anything)."""
    import torch

    try:
        where = torch.device(device)
    except RuntimeError:
        raise BadInputError(f"unknown --device {device!r}; choose cpu or cuda") from None
    if where.type not in ("cpu", "cuda"):
        raise BadInputError(f"unknown --device {device!r}; choose cpu or cuda")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise BadInputError(f"--device {device}: torch sees no CUDA GPU; use --device cpu")
    return where


def build_model(config: Any, *, seed: int, dtype: Any, device: Any) -> Any:
    """The random-init model of `config`, built and initialised on `device` in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _save_weights(tmp: Path, config: Any, tok: Any, *, seed: int, dtype: Any,
                  device: Any) -> None:
    model = build_model(config, seed=seed, dtype=dtype, device=device)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    shards = {} if device.type == "cpu" else {"max_shard_size": DEVICE_SHARD_SIZE}
    model.save_pretrained(str(tmp), safe_serialization=True, **shards)


class InitModelConfig(StageConfig):
    """`rltool init-model` (the `[init_model]` table of a config file; a loop's `[model]` table
    names existing weights instead)."""

    arch: str = Field("qwen2", description=f"HF architecture: {', '.join(ARCHS)}.")
    preset: str = Field("tiny", description=f"Model size: {', '.join(PRESETS)}.")
    task: str | None = Field(None, description="Built-in task the model is for (in config.json).")
    seed: int = Field(0, description="Init seed.")
    dtype: ComputeDtype = Field("fp32", description="Weight dtype.")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where the weights are drawn (cuda: seconds for the 7B shapes instead "
        "of minutes; a seed gives the same weights on the same kind of device only).")
    out: str = Field(description="Directory to create (must not exist).")
