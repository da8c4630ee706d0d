"""The torch backend's state on disk: `save` and `load` of its trainer checkpoints
(rltool.train.checkpoint's layout: the full model, or under LoRA the adapter alone; AdamW's state
by parameter name; every rank's RNG; PPO's value head) and `load_adapter` of a PEFT adapter
directory into its LoRA adapters. Functions of a TorchBackend, which delegates to them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rltool.errors import CheckpointError
from rltool.train import checkpoint as ckpt
from rltool.train import lora

if TYPE_CHECKING:
    from rltool.train.torch_backend import TorchBackend

log = logging.getLogger(__name__)
VALUE_HEAD = "value_head"  # attribute on the HF model, and the prefix of its state-dict keys


def _rng_states(b: TorchBackend) -> dict[str, torch.Tensor]:
    own = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        own["torch_cuda"] = torch.cuda.get_rng_state()
    return {f"{kind}/rank{r}": state for r, states in enumerate(b.all_gather_object(own))
            for kind, state in states.items()}


def save(b: TorchBackend, ckpt_dir: Path, *, trainer_state: dict[str, Any],
         data_tensors: dict[str, torch.Tensor], config_toml: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    assert b.optimizer is not None
    # LoRA: the adapter alone, the base is --load's, unchanged
    full_state = b.full_model_state() if b.lora is None else b.trained_state()
    model_state = {k: v for k, v in full_state.items() if not k.startswith(VALUE_HEAD + ".")}
    value_state = {k: v for k, v in full_state.items() if k.startswith(VALUE_HEAD + ".")}
    adapter = None if b.lora is None else b.lora.peft_config(b.model_dir)
    optim_state = (b.optimizer.state_dict() if b.masters else get_optimizer_state_dict(
        b.model, b.optimizer, options=b.full_state_options()))
    rng = _rng_states(b)
    if b.dp_rank == 0:
        backend_state = {"name": "torch", "optimizer_steps": b.optimizer_steps,
                         "world_size": b.dp_size, "dtype": b.options.dtype,
                         "parallel": b.options.parallel,
                         "value_head": b.value_head}
        if b.lora is not None:
            backend_state["lora"] = b.lora.describe()
        ckpt.write_checkpoint(Path(ckpt_dir), model_state=model_state,
                              optimizer_state=optim_state, rng_states=rng,
                              data_tensors=data_tensors, value_head=value_state,
                              trainer_state={**trainer_state, "backend": backend_state},
                              source_model_dir=b.model_dir, config_toml=config_toml,
                              adapter_config=adapter)
    if b.dp_size > 1:
        dist.barrier()


def load(b: TorchBackend, ckpt_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Restore optimizer, schedule step and RNG (the weights came from ckpt_dir/model)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    assert b.optimizer is not None
    ckpt_dir = Path(ckpt_dir)
    state = ckpt.read_trainer_state(ckpt_dir)
    had_value_head = bool(state["backend"].get("value_head", False))
    if had_value_head != b.value_head:
        raise CheckpointError(
            f"{ckpt_dir} was trained {'with' if had_value_head else 'without'} a value head "
            f"but this run {'needs' if b.value_head else 'has'} "
            f"{'one' if b.value_head else 'none'} (ppo vs other estimators); "
            f"to switch, --load {ckpt_dir / ckpt.MODEL_DIR} (weights only, fresh optimizer)")
    _check_lora(b, ckpt_dir, state["backend"].get("lora"))
    if b.value_head:
        if not (ckpt_dir / ckpt.VALUE_HEAD_FILE).exists():
            raise CheckpointError(f"{ckpt_dir}: missing {ckpt.VALUE_HEAD_FILE}; the checkpoint "
                                  "is incomplete")
        value_state = ckpt.read_tensors(ckpt_dir / ckpt.VALUE_HEAD_FILE)
        set_model_state_dict(b.model, value_state,
                             options=StateDictOptions(full_state_dict=True, strict=False))
        if b.masters:
            b.optimizer.load_masters(value_state)
    optim_state = ckpt.unflatten_optimizer_state(ckpt.read_tensors(ckpt_dir / ckpt.OPTIMIZER_FILE),
                                                 state["optimizer"])
    try:
        if b.masters:
            b.optimizer.load_state_dict(optim_state)
        else:
            set_optimizer_state_dict(b.model, b.optimizer, optim_state,
                                     options=StateDictOptions(full_state_dict=True))
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{ckpt_dir}: optimizer state does not fit the model ({e})") from e
    b.optimizer_steps = int(state["backend"]["optimizer_steps"])
    rng = ckpt.read_tensors(ckpt_dir / ckpt.RNG_FILE)
    own = rng.get(f"torch_cpu/rank{b.dp_rank}")
    if own is not None and state["backend"]["world_size"] == b.dp_size:
        torch.set_rng_state(own)
        if torch.cuda.is_available() and f"torch_cuda/rank{b.dp_rank}" in rng:
            torch.cuda.set_rng_state(rng[f"torch_cuda/rank{b.dp_rank}"])
    else:
        log.warning("checkpoint %s was written by %s ranks, this run has %s: RNG reseeded",
                    ckpt_dir, state["backend"]["world_size"], b.dp_size)
    return state, ckpt.read_tensors(ckpt_dir / ckpt.DATA_FILE)


def _check_lora(b: TorchBackend, ckpt_dir: Path, saved: dict[str, Any] | None) -> None:
    """The checkpoint's LoRA adapter into this model's, refused when they differ."""
    own = None if b.lora is None else b.lora.describe()
    if saved is None and own is None:
        return
    if saved is None:
        raise CheckpointError(f"{ckpt_dir} was trained without LoRA; to train adapters on its "
                              f"weights, --load {ckpt_dir / ckpt.MODEL_DIR} (fresh optimizer)")
    if own != saved:
        raise CheckpointError(
            f"{ckpt_dir} holds LoRA adapters of rank {saved['rank']}, alpha {saved['alpha']} "
            f"on {','.join(saved['targets'])}; resume with --lora-rank {saved['rank']} "
            f"--lora-alpha {saved['alpha']} --lora-target-modules "
            f"{','.join(saved['targets'])}")
    load_adapter(b, ckpt_dir / ckpt.ADAPTER_DIR)


def load_adapter(b: TorchBackend, directory: Path) -> None:
    """A PEFT adapter directory (a checkpoint's, a LoRA version, PEFT's save_pretrained)
    into this model's adapters; refused unless it is exactly their rank, alpha, targets and
    tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    assert b.lora is not None, "load_adapter without --lora-rank"
    config, tensors = lora.read_adapter(directory)
    b.lora.check_config(config, where=directory, base_model_dir=b.model_dir)
    own = {n: p.shape for n, p in b.inner.named_parameters() if lora.is_adapter_key(n)}
    theirs = {n: t.shape for n, t in tensors.items()}
    if own != theirs:
        odd = sorted(set(own.items()) ^ set(theirs.items()))[0][0]
        raise CheckpointError(f"{directory}: its tensors are not this model's adapters "
                              f"({odd} differs or is missing); pass the adapter trained "
                              "on this base")
    set_model_state_dict(b.model, tensors,
                         options=StateDictOptions(full_state_dict=True, strict=False))
    if b.masters:
        b.optimizer.load_masters(tensors)
