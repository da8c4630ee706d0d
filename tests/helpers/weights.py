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
