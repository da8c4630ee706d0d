"""Reading a HF checkpoint directory (config.json + *.safetensors) into the engine's model: the
index of its tensors from their headers, its quantization (block FP8 or INT4) checked, then every
tensor checked against the model before any is copied."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rltool.engine import quant
from rltool.errors import CheckpointError

if TYPE_CHECKING:  # the model module builds its models through this one
    from rltool.engine.dense_model import DenseLM


@dataclass(frozen=True)
class CheckpointIndex:
    files: list[Path]
    infos: dict[str, tuple[tuple[int, ...], str, Path]]  # name -> (shape, dtype, file)
    fmt: quant.Format | None
    shapes: dict[str, tuple[int, ...]]  # every weight, without FP8 scales or INT4 companions
    fp8: set[str]  # the quantized (FP8 or INT4) weights, each with its checked scales


def read_index(model_dir: Path) -> CheckpointIndex:
    """The tensors of a HF checkpoint directory (headers only), its quantization checked; a file
    that is not a readable safetensors file (truncated, corrupt) raises CheckpointError."""
    from safetensors import SafetensorError, safe_open

    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        raise CheckpointError(f"{model_dir} holds no *.safetensors files; pass a HF checkpoint "
                              "directory")
    infos: dict[str, tuple[tuple[int, ...], str, Path]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    sl = sf.get_slice(name)
                    infos[name] = (tuple(sl.get_shape()), sl.get_dtype(), f)
        except SafetensorError as e:
            raise CheckpointError(f"{f} is not a readable safetensors file ({e}); restore or "
                                  "re-save it") from e
    config_file = model_dir / "config.json"
    fmt = None
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{config_file} is not valid JSON ({e}); restore it") from e
        fmt = quant.read_format(config, where=str(model_dir)) if isinstance(config, dict) else None
    shapes, fp8 = quant.split_scales({n: (s, d) for n, (s, d, _) in infos.items()}, fmt,
                                     where=str(model_dir))
    return CheckpointIndex(files=files, infos=infos, fmt=fmt, shapes=shapes, fp8=fp8)


def load_checkpoint(model: DenseLM, model_dir: Path,
                    before_copy: Callable[[], None] | None = None, *,
                    index: CheckpointIndex | None = None) -> int:
    """Copy a HF checkpoint directory's tensors into `model` after checking every name and shape
    (and every FP8 weight's scales): nothing changes unless the whole checkpoint matches.
    `before_copy` runs before each tensor's copy. Returns the number of tensors copied."""
    from safetensors import safe_open

    index = index or read_index(model_dir)
    model.check_tensors(index.shapes, where=str(model_dir))
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt"))
                   for f in index.files}

        def get(key: str) -> torch.Tensor:
            return handles[index.infos[key][2]].get_tensor(key)

        def tensors(f: Path) -> Iterable[tuple[str, torch.Tensor | quant.BlockFp8]]:
            for key in handles[f].keys():
                name = quant.stored_name(key, index.fmt)
                if name not in index.shapes:
                    continue  # a scale, read with its weight
                if before_copy is not None:
                    before_copy()
                yield name, (quant.read_quantized(name, get, index.infos, index.fmt,
                                                  where=str(model_dir))
                             if name in index.fp8 else get(key))

        return sum(model.load_tensors(tensors(f)) for f in index.files)
