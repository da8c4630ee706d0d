"""Checkpoint builders for the delta tests (written with safetensors' own writer, independent of
rltool.delta's IO)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.float8_e4m3fn}


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], *, shards: int = 1,
                     version: int | None = None, extra: dict[str, str] | None = None) -> Path:
    """A HF-style directory: one model.safetensors, or `shards` files plus an index."""
    path.mkdir(parents=True)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k in range(shards):
            part = {n: tensors[n] for n in names[k::shards]}
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(path / fname), metadata={"format": "pt"})
            weight_map |= {n: fname for n in part}
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "test"}))
    for rel, text in (extra or {}).items():
        (path / rel).write_text(text)
    if version is not None:
        (path / "rltool_version.json").write_text(json.dumps({"version": version}))
    return path


def make_weights(dtype: str, *, seed: int, sizes: dict[str, tuple[int, ...]] | None = None
                 ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = sizes or {"embed": (300, 16), "layer.0.w": (16, 33), "layer.0.b": (33,),
                      "layer.1.w": (16, 16), "norm": (16,), "odd": (7,)}
    return {k: (torch.randn(s, generator=g) * 0.02).to(DTYPES[dtype]) for k, s in sizes.items()}


def perturb(w: dict[str, torch.Tensor], *, lr: float, seed: int,
            keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """One simulated optimizer step w + lr * sign(noise), rounded to the tensor's dtype."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in w.items():
        step = lr * torch.sign(torch.randn(v.shape, generator=g))
        out[k] = v.clone() if k in keep else (v.float() + step).to(v.dtype)
    return out


def load_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality (NaN-safe, -0.0 distinct from 0.0)."""
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)
