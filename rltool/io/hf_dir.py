"""HF checkpoint directories written from a state dict: config and tokenizer files copied from a
source model, the weights as one `model.safetensors` (rltool.train's checkpoints, published policy
versions, delta sync's staging), and the side-file copy that conversions share.

Copies get the mode of every published file (rltool.atomic), not the source's: a source readable
only by its owner must not make a published version unreadable to an engine running as another
user.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

from rltool import atomic
from rltool.errors import CheckpointError
from rltool.io.header import INDEX_NAME
from rltool.rundir import VERSION_FILE

# PEFT's LoRA adapter directory (docs/formats.md, "LoRA adapters"): its config and its weights
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

WEIGHTS_FILE = "model.safetensors"
CONFIG_NAME = "config.json"
# Weight files of a source model: a written directory gets its own weights instead.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
          "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def copy_side_files(src: str | os.PathLike, dst: Path, *,
                    skip: Container[str] = (CONFIG_NAME, INDEX_NAME)) -> None:
    """Copy the top-level tokenizer, generation config and other small files of `src` into `dst`:
    not weights, not hidden files, not the names in `skip` (rewritten by the caller)."""
    for entry in sorted(Path(src).iterdir()):
        if (entry.is_file() and entry.name not in skip and not entry.name.startswith(".")
                and not entry.name.endswith(WEIGHT_SUFFIXES)):
            shutil.copyfile(entry, dst / entry.name)


def write_hf_dir(out: Path, state_dict: dict[str, Any], *, source_model_dir: str | os.PathLike,
                 dtype: str, quantize: Callable[[dict[str, Any]], tuple[dict[str, Any],
                                                                       dict[str, Any]]]
                 | None = None) -> None:
    """Fill `out` with config + tokenizer files from `source_model_dir` and `state_dict` cast to
    `dtype` (fp32, bf16 or fp16) as model.safetensors. `quantize`: turns the cast tensors into
    the stored ones and returns them with config.json's quantization_config."""
    import torch
    from safetensors.torch import save_file

    source = Path(source_model_dir)
    if not (source / CONFIG_NAME).exists():
        raise CheckpointError(f"{source} has no config.json; the source model must be a HF "
                              "checkpoint directory")
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown weights dtype {dtype!r}; choose fp32, bf16 or fp16")
    copy_side_files(source, out, skip=(VERSION_FILE,))
    torch_dtype = getattr(torch, DTYPES[dtype])
    config = json.loads((out / CONFIG_NAME).read_text())
    config["dtype"] = DTYPES[dtype]
    if "torch_dtype" in config:  # transformers < 5 spelling
        config["torch_dtype"] = DTYPES[dtype]
    if config.get("tie_word_embeddings"):
        # Tied heads share the embedding's storage; HF re-ties them on load.
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    tensors = {k: v.detach().to(device="cpu", dtype=torch_dtype).contiguous()
               for k, v in state_dict.items()}
    if quantize is not None:
        tensors, config["quantization_config"] = quantize(tensors)
    atomic.write_json(out / CONFIG_NAME, config)
    with atomic.atomic_path(out / WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
