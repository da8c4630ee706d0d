"""Checkpoint directories: the one index reader, the one file-name check, and a full HF checkpoint
seen as raw tensors (name -> file, dtype, shape, byte range).

Covers the three layouts HF writes: `model.safetensors.index.json` + shards, one
`model.safetensors`, or several `*.safetensors` without an index. Everything that is not a weight
file (config.json, tokenizer, `rltool_version.json`, ...) is an "extra file", carried verbatim.

Every file name an index names (a full checkpoint's or a delta's `weight_map`, a delta's
`rltool_delta.files` and `removed_files`) passes `check_name`: a plain relative name that stays
inside its directory, named once. Readers open, and writers create, only names that passed it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rltool.errors import CheckpointError
from rltool.io.header import INDEX_NAME, TensorInfo
from rltool.io.reader import SafetensorsFile, read_header

_SKIP_PREFIXES = (".",)  # temporaries and the pull state directory


def check_name(root: Path, name: object, *, what: str) -> str:
    """`name` if it is a plain relative file name inside `root` (no absolute path, no empty, `.`
    or `..` component, no link leading out of `root`); else CheckpointError naming it."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{what}: file name {name!r} is not a non-empty string")
    if (name.startswith("/") or "\\" in name or "\0" in name
            or any(part in ("", ".", "..") for part in name.split("/"))):
        raise CheckpointError(f"{what}: file name {name!r} is not a plain relative name inside "
                              f"{root}; refusing the index")
    real_root = root.resolve()
    if not (root / name).resolve().is_relative_to(real_root):
        raise CheckpointError(f"{what}: {name!r} is a link leading out of {root}; refusing it "
                              "(copy the checkpoint with its links resolved, e.g. `cp -rL`)")
    return name


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CheckpointError(f"key {key!r} appears twice")
        out[key] = value
    return out


def read_index(path: Path) -> dict:
    """A safetensors index (full checkpoint or delta) with every file name it carries checked:
    `weight_map` values, and a delta's `rltool_delta.files` / `removed_files`. Duplicate keys,
    repeated names and extra files that shadow a weight file are refused."""
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_no_duplicate_keys)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no such file") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}; an index names every tensor and file once") from e
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise CheckpointError(f"{path}: no weight_map object")
    root, what = path.parent, str(path)
    weight_files = {check_name(root, f, what=what) for f in data["weight_map"].values()}
    extra = data.get("rltool_delta")
    if isinstance(extra, dict):
        files, removed = extra.get("files", {}), extra.get("removed_files", [])
        if not isinstance(files, dict) or not isinstance(removed, list):
            raise CheckpointError(f"{path}: rltool_delta.files must be an object and "
                                  "removed_files a list")
        names = [check_name(root, n, what=what) for n in list(files) + removed]
        # Extra files never shadow weights: those are rebuilt, not copied.
        clash = sorted({n for n in names if names.count(n) > 1}
                       | {n for n in names if n.endswith(".safetensors")}
                       | (set(names) & (weight_files | {INDEX_NAME})))
        if clash:
            raise CheckpointError(f"{path}: file {clash[0]!r} is named twice (as extra, removed "
                                  "or weight file); refusing the index")
    return data


def is_delta_dir(root: str | os.PathLike) -> bool:
    """A version directory is a delta when its index metadata names a delta encoding (slime's rule)."""
    index = Path(root) / INDEX_NAME
    if not index.is_file():
        return False
    meta = read_index(index).get("metadata") or {}
    return isinstance(meta, dict) and "delta_encoding" in meta


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    files: dict[str, SafetensorsFile]  # file name -> parsed header
    tensor_file: dict[str, str]  # tensor name -> file name, in file then offset order
    members: frozenset[str] | None = None  # the only files that belong to it (None: every file)

    def entry(self, name: str) -> TensorInfo:
        return self.files[self.tensor_file[name]].entries[name]

    def names(self) -> list[str]:
        return list(self.tensor_file)

    def tensors(self) -> dict[str, TensorInfo]:
        return {name: self.entry(name) for name in self.tensor_file}

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
        """Relative paths of non-weight files (recursively, or among `members`), sorted."""
        out = []
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root).as_posix()
            if not p.is_file() or any(part.startswith(_SKIP_PREFIXES) for part in rel.split("/")):
                continue
            if p.suffix == ".safetensors" or rel == INDEX_NAME:
                continue
            if self.members is None or rel in self.members:
                out.append(rel)
        return out


def open_checkpoint(root: str | os.PathLike, *, members: frozenset[str] | None = None
                    ) -> Checkpoint:
    """Open a full checkpoint directory (headers only). `members`: the files that belong to it
    when the directory holds others too (a pull's local directory); weights are then looked up
    among them when there is no index."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    index = root / INDEX_NAME
    wm = None
    if index.is_file() and (members is None or INDEX_NAME in members):
        data = read_index(index)
        if "delta_encoding" in (data.get("metadata") or {}):
            raise CheckpointError(f"{root} is a delta version, not a full checkpoint; "
                                  "reconstruct it with `rltool delta apply` first")
        wm = data["weight_map"]
        names = sorted(set(wm.values()))
    else:
        names = sorted(p.name for p in root.glob("*.safetensors")
                       if members is None or p.name in members)
        for n in names:
            check_name(root, n, what=str(root))
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
    if wm is not None and (set(wm) != set(tensor_file)
                           or any(tensor_file[t] != f for t, f in wm.items())):
        raise CheckpointError(f"{index}: weight_map does not match the shards' contents")
    return Checkpoint(root, files, tensor_file, members)


def checkpoint_tensors(directory: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of an HF checkpoint directory, by name, across its shards (headers only)."""
    return open_checkpoint(directory).tensors()
