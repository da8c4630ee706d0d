"""Trainer checkpoints (`--save DIR` -> DIR/step-NNNNNN/), safetensors + JSON only, never pickle.

```
step-000007/
  model/                      full HF checkpoint of the fp32 master weights (transformers loads it;
                              `--load` accepts it)
  adapter/                    LoRA (`--lora-rank`) instead of model/: the fp32 adapter in PEFT's
                              layout (rltool.train.lora), whose adapter_config.json names the
                              base model directory (never copied: it does not change)
  optimizer.safetensors       AdamW moments "<param>/exp_avg", "<param>/exp_avg_sq" (fp32, full;
                              the adapter's only under LoRA)
  rng.safetensors             torch generator states "torch_cpu/rank<r>" ("torch_cuda/rank<r>")
  data.safetensors            the stage's per-sample tensors of the sample set being trained
                              (old/ref logprobs, advantages), so a resumed run continues bit-exactly
  value_head.safetensors      PPO only: the value head "value_head.weight", "value_head.bias"
  dist/                       megatron backend only, instead of optimizer.safetensors: torch_dist
                              model and optimizer shards (rltool.train.megatron_state)
  config.toml                 the resolved TrainConfig
  trainer_state.json          written last, the completeness marker: format, versions, optimizer
                              scalars and hyper-parameters, LR-schedule step, data position
```
The directory is built under a temporary name and renamed (rltool.atomic.publish_dir).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltool import __version__, atomic
from rltool.errors import CheckpointError
from rltool.io.hf_dir import ADAPTER_CONFIG, write_hf_dir
from rltool.rundir import declared_version, parse_step_dir_name, read_json_file

FORMAT = "rltool-trainer-checkpoint"
FORMAT_VERSION = 1
STATE_FILE = "trainer_state.json"
MODEL_DIR = "model"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
DATA_FILE = "data.safetensors"
VALUE_HEAD_FILE = "value_head.safetensors"
DIST_DIR = "dist"
ADAPTER_DIR = "adapter"


@dataclass(frozen=True)
class LoadTarget:
    """What `--load` resolved to: the HF model directory to build from, and the trainer checkpoint
    (None for plain weights) whose optimizer/RNG/data state to restore, or the LoRA adapter
    directory (a published LoRA version, PEFT's save_pretrained) whose adapter starts the run."""

    model_dir: Path
    ckpt_dir: Path | None
    version: int
    adapter_dir: Path | None = None


def resolve_load(path: str | os.PathLike, *, adapter: bool = False) -> LoadTarget:
    """Accept a HF weights dir, a checkpoint step-NNNNNN, or a --save dir (newest step wins);
    with `adapter` (a caller that loads it: the train stage's and the resident trainer's --load)
    also a LoRA adapter directory and a LoRA checkpoint, which others refuse rather than read as
    their base."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"--load {path}: no such directory")
    if (path / STATE_FILE).exists():
        state = read_trainer_state(path)
        if not adapter and state.get("backend", {}).get("lora"):
            raise CheckpointError(f"{path} is a LoRA checkpoint (an adapter over its base), not "
                                  "full weights: pass weights published with "
                                  "--lora-merge-on-publish, or the base")
        return LoadTarget(model_dir=_model_dir(path, state), ckpt_dir=path,
                          version=int(state["policy_version"]))
    if (path / "config.json").exists():
        return LoadTarget(model_dir=path, ckpt_dir=None, version=declared_version(path) or 0)
    if (path / ADAPTER_CONFIG).exists():
        if not adapter:
            raise CheckpointError(f"{path} is a LoRA adapter, not full weights: pass the merged "
                                  "weights (rltool train --lora-merge-on-publish) or the base")
        return LoadTarget(model_dir=adapter_base(path), ckpt_dir=None,
                          version=declared_version(path) or 0, adapter_dir=path)
    steps = sorted((s, p) for p in path.iterdir()
                   if (s := parse_step_dir_name(p.name)) is not None and (p / STATE_FILE).exists())
    if steps:
        return resolve_load(steps[-1][1], adapter=adapter)
    raise CheckpointError(f"--load {path}: neither a HF weights directory (config.json), a LoRA "
                          f"adapter ({ADAPTER_CONFIG}), a trainer checkpoint ({STATE_FILE}) nor a "
                          "directory of step-NNNNNN checkpoints")


def _model_dir(ckpt_dir: Path, state: dict[str, Any]) -> Path:
    """The HF directory a checkpoint's model is built from: its model/, or under LoRA the base
    model its adapter names."""
    if not state.get("backend", {}).get("lora"):
        return ckpt_dir / MODEL_DIR
    return adapter_base(ckpt_dir / ADAPTER_DIR)


def adapter_base(adapter_dir: Path) -> Path:
    """The base model directory a LoRA adapter's adapter_config.json names (which must be a HF
    weights directory)."""
    config = read_json_file(adapter_dir / ADAPTER_CONFIG, what=ADAPTER_CONFIG)
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not base or not (Path(base) / "config.json").is_file():
        raise CheckpointError(f"{adapter_dir}: the base model of the LoRA adapter ({base}) is not "
                              "a HF weights directory here; put it there (its "
                              f"{ADAPTER_CONFIG} names it in base_model_name_or_path)")
    return Path(base)


def read_trainer_state(ckpt_dir: Path) -> dict[str, Any]:
    state = read_json_file(ckpt_dir / STATE_FILE, what=STATE_FILE)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt_dir}: {STATE_FILE} is not an rltool trainer checkpoint")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt_dir}: checkpoint format version {state.get('format_version')} "
                              f"is not {FORMAT_VERSION}; use the rltool that wrote it")
    megatron = state.get("backend", {}).get("name") == "megatron"
    model = (ADAPTER_DIR + "/" + ADAPTER_CONFIG if state.get("backend", {}).get("lora")
             else MODEL_DIR + "/config.json")
    for name in (model, DIST_DIR if megatron else OPTIMIZER_FILE, RNG_FILE):
        if not (ckpt_dir / name).exists():
            raise CheckpointError(f"{ckpt_dir}: missing {name}; the checkpoint is incomplete")
    return state


def flatten_optimizer_state(osd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A full (unsharded) torch optimizer state dict keyed by parameter names -> (tensors, JSON).

    Tensors with more than one element go to safetensors as "<param>/<key>"; 0-d tensors (AdamW's
    step) and hyper-parameters go to JSON with their dtype, so loading rebuilds them exactly.
    """
    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, entry in osd["state"].items():
        for key, value in entry.items():
            if hasattr(value, "dim") and value.dim() > 0:
                tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
            elif hasattr(value, "dim"):
                scalars.setdefault(name, {})[key] = {"value": value.item(),
                                                     "dtype": str(value.dtype).split(".")[-1]}
            else:
                scalars.setdefault(name, {})[key] = {"value": value, "dtype": None}
    return tensors, {"param_groups": osd["param_groups"], "scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    import torch

    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        state.setdefault(name, {})[field] = value
    for name, entries in meta["scalars"].items():
        for field, item in entries.items():
            value = item["value"]
            if item["dtype"] is not None:
                value = torch.tensor(value, dtype=getattr(torch, item["dtype"]))
            state.setdefault(name, {})[field] = value
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g)
              for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def write_checkpoint(ckpt_dir: Path, *, model_state: dict[str, Any], optimizer_state: dict[str, Any],
                     rng_states: dict[str, Any], data_tensors: dict[str, Any],
                     value_head: dict[str, Any],
                     trainer_state: dict[str, Any], source_model_dir: Path,
                     config_toml: str, adapter_config: dict[str, Any] | None = None) -> Path:
    """Write one checkpoint directory atomically (rank 0 only); refuses to replace one.
    `adapter_config`: LoRA, `model_state` is the adapter, written to adapter/ with this config."""
    from safetensors.torch import save_file

    if ckpt_dir.exists():
        raise CheckpointError(f"{ckpt_dir} already exists; checkpoints are never replaced "
                              "(--load it to resume, or --save elsewhere)")
    opt_tensors, opt_meta = flatten_optimizer_state(optimizer_state)
    state = {"format": FORMAT, "format_version": FORMAT_VERSION, "rltool_version": __version__,
             "optimizer": opt_meta, **trainer_state}
    with atomic.publish_dir(ckpt_dir, marker=STATE_FILE, marker_content=state) as tmp:
        if adapter_config is not None:
            from rltool.train.lora import write_adapter

            (tmp / ADAPTER_DIR).mkdir()
            write_adapter(tmp / ADAPTER_DIR, tensors=model_state, config=adapter_config)
        else:
            (tmp / MODEL_DIR).mkdir()
            write_hf_dir(tmp / MODEL_DIR, model_state, source_model_dir=source_model_dir,
                         dtype="fp32")
        files = [(OPTIMIZER_FILE, opt_tensors), (RNG_FILE, rng_states), (DATA_FILE, data_tensors)]
        if value_head:
            files.append((VALUE_HEAD_FILE, value_head))
        for name, tensors in files:
            with atomic.atomic_path(tmp / name) as part:
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(part))
        atomic.write_text(tmp / "config.toml", config_toml)
    return ckpt_dir


def read_tensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    if not path.exists():
        return {}
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own SafetensorError for corrupt headers
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from e
