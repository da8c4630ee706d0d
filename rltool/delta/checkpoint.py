"""A full HF checkpoint directory seen as raw tensors: name -> (file, dtype, shape, byte range).

Covers the three layouts HF writes: `model.safetensors.index.json` + shards, one
`model.safetensors`, or several `*.safetensors` without an index. Everything that is not a weight
file (config.json, tokenizer, `rltool_version.json`, ...) is an "extra file", carried verbatim.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rltool.convert.safetensors_io import INDEX_NAME, TensorInfo
from rltool.delta.safetensors_io import SafetensorsFile, read_header
from rltool.errors import CheckpointError

_SKIP_PREFIXES = (".",)  # temporaries and the pull state directory


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    files: dict[str, SafetensorsFile]  # file name -> parsed header
    tensor_file: dict[str, str]  # tensor name -> file name, in file then offset order

    def entry(self, name: str) -> TensorInfo:
        return self.files[self.tensor_file[name]].entries[name]

    def names(self) -> list[str]:
        return list(self.tensor_file)

    def spec(self, name: str) -> tuple[str, tuple[int, ...], int]:
        e = self.entry(name)
        return e.dtype, e.shape, e.nbytes

    def read(self, name: str, *, out: np.ndarray | None = None) -> np.ndarray:
        """A private writable copy of tensor bytes (into `out` when given)."""
        return self.files[self.tensor_file[name]].read(name, out=out)

    def view(self, name: str, *, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Read-only zero-copy bytes (mmap)."""
        return self.files[self.tensor_file[name]].view(name, offset=offset, nbytes=nbytes)

    def extra_paths(self) -> dict[str, Path]:
        return {rel: self.root / rel for rel in self.extra_files()}

    def extra_files(self) -> list[str]:
        """Relative paths of non-weight files (recursively), sorted."""
        out = []
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root)
            if not p.is_file() or any(part.startswith(_SKIP_PREFIXES) for part in rel.parts):
                continue
            if p.suffix == ".safetensors" or rel.as_posix() == INDEX_NAME:
                continue
            out.append(rel.as_posix())
        return out


def read_index(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no such file") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise CheckpointError(f"{path}: no weight_map object")
    return data


def is_delta_dir(root: str | os.PathLike) -> bool:
    """A version directory is a delta when its index metadata names a delta encoding (slime's rule)."""
    index = Path(root) / INDEX_NAME
    if not index.is_file():
        return False
    meta = read_index(index).get("metadata") or {}
    return isinstance(meta, dict) and "delta_encoding" in meta


def open_checkpoint(root: str | os.PathLike) -> Checkpoint:
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    index = root / INDEX_NAME
    if index.is_file():
        data = read_index(index)
        if "delta_encoding" in (data.get("metadata") or {}):
            raise CheckpointError(f"{root} is a delta version, not a full checkpoint; "
                                  "reconstruct it with `rltool delta apply` first")
        names = sorted(set(data["weight_map"].values()))
    else:
        names = sorted(p.name for p in root.glob("*.safetensors"))
    if not names:
        raise CheckpointError(f"{root}: no safetensors weights (expected {INDEX_NAME} or "
                              "*.safetensors)")
    files = {n: read_header(root / n) for n in names}
    tensor_file: dict[str, str] = {}
    for n in names:
        for t in files[n].entries:
            if t in tensor_file:
                raise CheckpointError(f"{root}: tensor {t!r} appears in {tensor_file[t]} and {n}")
            tensor_file[t] = n
    if index.is_file():
        wm = read_index(index)["weight_map"]
        if set(wm) != set(tensor_file) or any(tensor_file[t] != f for t, f in wm.items()):
            raise CheckpointError(f"{index}: weight_map does not match the shards' contents")
    return Checkpoint(root, files, tensor_file)
