"""Publishing a policy version: a full HF checkpoint `<publish>/weight_vNNNNNN` that transformers
and the engines load (config, tokenizer files copied from the source model, model.safetensors,
`rltool_version.json` {"version": N}), written under a temporary name and renamed.

`publish_weights` is the one entry point; weight-sync variants (delta publishing) build on it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from rltool import atomic
from rltool.rundir import VERSION_FILE
from rltool.errors import CheckpointError
from rltool.rundir import weight_dir_name

WEIGHTS_FILE = "model.safetensors"
# Files of the source model that a published version must not inherit: the weights (replaced)
# and the version marker (rewritten).
_SKIP_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "float32": "float32", "bfloat16": "bfloat16"}


def write_hf_dir(out: Path, state_dict: dict[str, Any], *, source_model_dir: str | os.PathLike,
                 dtype: str) -> None:
    """Fill `out` with config + tokenizer files from `source_model_dir` and `state_dict` cast to
    `dtype` (fp32 or bf16) as model.safetensors."""
    import torch
    from safetensors.torch import save_file

    source = Path(source_model_dir)
    if not (source / "config.json").exists():
        raise CheckpointError(f"{source} has no config.json; the source model must be a HF "
                              "checkpoint directory")
    for entry in sorted(source.iterdir()):
        if (entry.is_file() and entry.name != VERSION_FILE and not entry.name.startswith(".")
                and not entry.name.endswith(_SKIP_SUFFIXES)):
            shutil.copy2(entry, out / entry.name)
    torch_dtype = getattr(torch, DTYPES[dtype])
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = DTYPES[dtype]
    if "torch_dtype" in config:  # transformers < 5 spelling
        config["torch_dtype"] = DTYPES[dtype]
    atomic.write_json(out / "config.json", config)
    if config.get("tie_word_embeddings"):
        # Tied heads share the embedding's storage; HF re-ties them on load.
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    tensors = {k: v.detach().to(device="cpu", dtype=torch_dtype).contiguous()
               for k, v in state_dict.items()}
    with atomic.atomic_path(out / WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})


def publish_weights(state_dict: dict[str, Any], *, source_model_dir: str | os.PathLike,
                    publish_dir: str | os.PathLike, version: int, dtype: str = "fp32") -> Path:
    """Publish `state_dict` (HF names) as `<publish_dir>/weight_vNNNNNN`; returns its path.

    Refuses to replace an existing version (a version number names one set of weights forever).
    """
    final = Path(publish_dir) / weight_dir_name(version)
    if final.exists():
        raise CheckpointError(f"{final} already exists; a published version is never replaced "
                              "(resume from the checkpoint that produced it, or publish elsewhere)")
    with atomic.publish_dir(final, marker=VERSION_FILE, marker_content={"version": version}) as tmp:
        write_hf_dir(tmp, state_dict, source_model_dir=source_model_dir, dtype=dtype)
    return final
