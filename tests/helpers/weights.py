"""Weight directories derived from a served one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PERTURBED_TENSOR = "model.layers.1.mlp.down_proj.weight"


def copy_weights(src: Path, dst: Path, *, version: int | None = None) -> Path:
    """A copy of a HF weights dir; `version` rewrites rltool_version.json."""
    shutil.copytree(src, dst)
    if version is not None:
        (dst / "rltool_version.json").write_text(json.dumps({"version": version}))
    return dst


def other_tokenizer_copy(src: Path, dst: Path) -> Path:
    """A copy of a HF weights dir whose tokenizer.json maps one digit's id to another text (a
    different tokenizer hash, same shapes)."""
    copy_weights(src, dst)
    data = json.loads((dst / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    digit = next(k for k in vocab if len(k) == 1 and k.isdigit())
    vocab["§"] = vocab.pop(digit)
    (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst
