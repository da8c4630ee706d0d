"""State of the megatron trainer: HF weights in, HF tensors out, and resumable checkpoints.

- `load_hf_weights`: every rank fills its own shards of the GPTModel from an HF directory
  (rltool.convert's name map: fused QKV per query group, gate/up halves, padded vocabulary).
- `export_hf`: the full HF-named tensors of the current policy on global rank 0, gathered over
  TP, PP and EP (one main replica of each shard, assembled and split back into HF tensors by the
  converter's inverse map), in the parameters' dtype (bf16 with `--dtype bf16`). The train stage
  publishes it through rltool.delta for every sync mode, as it does the torch backend's.
- `save_checkpoint` / `load_checkpoint`: the trainer checkpoint of rltool.train.checkpoint with
  `dist/` (a torch_dist checkpoint of the model and optimizer shards, megatron-core's
  `dist_checkpointing`) in place of optimizer.safetensors. `model/` holds the full HF weights in
  fp32, so `--load step-N/model` starts any backend or engine from it. Under LoRA, `adapter/`
  (PEFT's layout, fp32) replaces `model/` and dist/ holds the adapters' shards and optimizer
  state only: resuming builds the base from the directory adapter_config.json names. Resuming
  restores model, optimizer moments and master weights, RNG and schedule position bit for bit;
  it needs the layout (TP/PP/EP/CP, the distributed optimizer, the adapters) the checkpoint was
  written with.
- With the distributed optimizer over torch's Adam (no apex or transformer-engine), loading
  sets up and afterwards restores each parameter's Adam `step`, which megatron-core 0.16 cannot
  load by itself (`_allocate_adam_state`, `_restore_adam_steps`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rltool import __version__, atomic
from rltool.errors import CheckpointError
from rltool.train import checkpoint as ckpt

if TYPE_CHECKING:
    from rltool.train.megatron_backend import MegatronBackend

log = logging.getLogger(__name__)


def load_hf_weights(model: Any, hf_dir: Path) -> None:
    from rltool.convert.torch_dist import load_hf_weights as fill

    fill(model, hf_dir)


def gather_slots(module: Any, *, keep: Callable[[str], bool] | None = None
                 ) -> dict[Any, torch.Tensor]:
    """The global megatron tensors of `module` (slot -> full tensor, in the parameters' dtype)
    whose keys `keep` accepts (default: all) on global rank 0, assembled from one main replica
    of each shard of every rank; an empty dict elsewhere. Collective."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    from rltool.convert.torch_dist import shard_region, sharded_tensors

    own: dict[Any, tuple[tuple[int, ...], list[tuple[tuple[slice, ...], torch.Tensor]]]] = {}
    for slot, shards in sharded_tensors(module.sharded_state_dict()).items():
        if keep is not None and not keep(slot[0]):
            continue
        pieces = [(shard_region(sh), sh.data.detach().reshape(sh.local_shape).cpu().clone())
                  for sh in shards if is_main_replica(sh.replica_id)]
        if pieces:
            first = shards[0]
            own[slot] = (tuple(first.global_shape[first.prepend_axis_num:]), pieces)
    parts = [own]
    if dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(own, parts, dst=0)
    if dist.get_rank() != 0:
        return {}
    merged: dict[Any, tuple[tuple[int, ...], list]] = {}
    for part in parts:
        for slot, (shape, pieces) in part.items():
            merged.setdefault(slot, (shape, []))[1].extend(pieces)
    out = {}
    for slot, (shape, pieces) in sorted(merged.items()):
        full = pieces[0][1].new_empty(shape)
        for region, tensor in pieces:
            full[region] = tensor
        out[slot] = full
    return out


def export_hf(module: Any, hf_config: dict[str, Any], *,
              slots: dict[Any, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Full HF tensors on global rank 0 (an empty dict elsewhere), from `slots` (default: a
    fresh `gather_slots`, collective); LoRA adapters are left out (rltool.train.megatron_lora)."""
    from rltool.convert import name_map
    from rltool.train.megatron_lora import is_adapter_key

    slots = gather_slots(module) if slots is None else slots
    shapes = name_map.Shapes.from_hf(hf_config)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for (key, index), full in slots.items():
        if (key == "output_layer.weight" and tied) or is_adapter_key(key):
            continue
        names = name_map.hf_names(key, index, tied=tied)
        out.update(zip(names, name_map.to_hf(name_map.RULES[key][0], full, shapes=shapes),
                       strict=True))
    return out


def _layout(backend: MegatronBackend) -> dict[str, Any]:
    o = backend.options
    return {"tensor_model_parallel_size": o.tensor_model_parallel_size,
            "pipeline_model_parallel_size": o.pipeline_model_parallel_size,
            "context_parallel_size": o.context_parallel_size,
            "expert_model_parallel_size": o.expert_model_parallel_size,
            "expert_tensor_parallel_size": o.expert_tensor_parallel_size
            or o.tensor_model_parallel_size,
            "use_distributed_optimizer": o.use_distributed_optimizer,
            "world_size": dist.get_world_size(),
            "lora": backend.lora.describe() if backend.lora is not None else None}


# The distributed optimizer's state as one ShardedTensor per contiguous buffer range: saved and
# loaded by every rank in parallel without communication, resharded only over DP (resume needs
# the layout anyway). megatron-core 0.16's default (fully_sharded_model_space) writes flattened
# ranges, which its own checkpointing now refuses.
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def _torch_adam_parts(optimizer: Any) -> Iterator[tuple[Any, torch.optim.Optimizer]]:
    """(distributed optimizer, its torch Adam) for each part of `optimizer` that pairs them (no
    apex or transformer-engine: megatron falls back to torch's Adam, which keeps a `step` per
    parameter where the fused Adams keep one per group)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(part, DistributedOptimizer) and isinstance(part.optimizer, torch.optim.Adam):
            yield part, part.optimizer


def _hybrid_parts(optimizer: Any) -> Iterator[Any]:
    """The HybridDeviceOptimizers (`--optimizer-cpu-offload`) inside `optimizer`."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(getattr(part, "optimizer", None), HybridDeviceOptimizer):
            yield part.optimizer


def _allocate_adam_state(optimizer: Any) -> None:
    """Before loading: give every parameter of a torch Adam that has not stepped yet megatron's
    zero moments and a `step` of 0. Torch's Adam creates its state at the first step; without it
    the distributed optimizer's `state_dict`, which its `sharded_state_dict` reads when loading
    too, finds no step and fails its assertion that the parameters' steps agree. The
    checkpoint's values replace these."""
    for part, adam in _torch_adam_parts(optimizer):
        if adam.state:
            continue
        part.init_state_fn(adam, part.config)
        for group in adam.param_groups:
            for param in group["params"]:
                adam.state[param]["step"] = torch.zeros((), dtype=torch.float32)
    for hybrid in _hybrid_parts(optimizer):  # the same, in each of its torch AdamWs
        if hybrid.state:
            continue
        for sub in hybrid.sub_optimizers:
            for group in sub.param_groups:
                for param in group["params"]:
                    sub.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                                        "exp_avg": torch.zeros_like(param),
                                        "exp_avg_sq": torch.zeros_like(param)}
        hybrid._sync_sub_optimizers_state_to_hdo()


def _restore_adam_steps(optimizer: Any) -> None:
    """After loading: each parameter's `step`, its own tensor, from the step its parameter group
    was saved with. The distributed optimizer's `load_state_dict` sets every parameter's step from
    the groups, but as one shared tensor (which torch's Adam would increment once per parameter),
    and then copies the loading template's step tensors back over it (the template's 0)."""
    for _, adam in _torch_adam_parts(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                adam.state[param]["step"] = torch.tensor(float(group["step"]),
                                                         dtype=torch.float32)
    for hybrid in _hybrid_parts(optimizer):  # every group stepped as often: one step count
        step = max(float(group.get("step", 0)) for group in hybrid.param_groups)
        for sub in hybrid.sub_optimizers:
            for state in sub.state.values():
                state["step"] = torch.tensor(step, dtype=torch.float32)


def _sharded_state(backend: MegatronBackend, *, loading: bool) -> dict[str, Any]:
    """Model and optimizer shards; under LoRA the adapters' alone (the frozen base is the
    adapter's base model directory, which never changes)."""
    from rltool.train.megatron_lora import is_adapter_key

    if loading:
        _allocate_adam_state(backend.optimizer)
    model = backend.module.sharded_state_dict()
    if backend.lora is not None:
        model = {k: v for k, v in model.items() if is_adapter_key(k)}
    return {"model": model,
            "optimizer": backend.optimizer.sharded_state_dict(model, is_loading=loading,
                                                              metadata=OPTIMIZER_SHARDING)}


def _rng_states(backend: MegatronBackend) -> dict[str, torch.Tensor]:
    own = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        own["torch_cuda"] = torch.cuda.get_rng_state()
    return {f"{kind}/rank{r}": state for r, states in enumerate(backend.all_gather_object(own))
            for kind, state in states.items()}


def save_checkpoint(backend: MegatronBackend, ckpt_dir: Path, *, trainer_state: dict[str, Any],
                    data_tensors: dict[str, torch.Tensor], config_toml: str) -> None:
    """Write `ckpt_dir` atomically; collective (every rank writes its shards of dist/, global
    rank 0 the rest, then renames the directory into place)."""
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    from rltool.io.hf_dir import write_hf_dir
    from rltool.train.lora import write_adapter

    assert backend.optimizer is not None
    if ckpt_dir.exists():  # every rank sees the same filesystem: all refuse together
        raise CheckpointError(f"{ckpt_dir} already exists; checkpoints are never replaced "
                              "(--load it to resume, or --save elsewhere)")
    lora = backend.lora
    hf_state = backend.export_adapter() if lora is not None else backend.export_hf_state_dict()
    rng = _rng_states(backend)
    sharded = _sharded_state(backend, loading=False)
    state = {"format": ckpt.FORMAT, "format_version": ckpt.FORMAT_VERSION,
             "rltool_version": __version__, **trainer_state,
             "backend": {"name": "megatron", "optimizer_steps": backend.optimizer_steps,
                         "dtype": backend.options.dtype, **_layout(backend)}}
    if dist.get_rank() != 0:
        holder: list[Any] = [None]
        dist.broadcast_object_list(holder, src=0)
        dist_checkpointing.save(sharded, holder[0])
        dist.barrier()
        dist.barrier()
        return
    with atomic.publish_dir(ckpt_dir, marker=ckpt.STATE_FILE, marker_content=state) as tmp:
        (tmp / ckpt.DIST_DIR).mkdir()
        holder = [str(tmp / ckpt.DIST_DIR)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(holder, src=0)
        dist_checkpointing.save(sharded, holder[0])
        if lora is not None:  # the adapter in PEFT's layout, naming its base model
            (tmp / ckpt.ADAPTER_DIR).mkdir()
            write_adapter(tmp / ckpt.ADAPTER_DIR, tensors=hf_state,
                          config=lora.peft_config(backend.model_dir))
        else:
            (tmp / ckpt.MODEL_DIR).mkdir()
            write_hf_dir(tmp / ckpt.MODEL_DIR, hf_state, source_model_dir=backend.model_dir,
                         dtype="fp32")
        for name, tensors in ((ckpt.RNG_FILE, rng), (ckpt.DATA_FILE, data_tensors)):
            with atomic.atomic_path(tmp / name) as part:
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(part))
        atomic.write_text(tmp / "config.toml", config_toml)
        if dist.get_world_size() > 1:
            dist.barrier()  # every rank's shards are on disk before the rename
    if dist.get_world_size() > 1:
        dist.barrier()


def _weights_only_common_strategy() -> Any:
    """megatron-core's common-state loader with `torch.load(weights_only=True)` spelled out."""
    from megatron.core.dist_checkpointing.strategies.common import (COMMON_STATE_FNAME,
                                                                    TorchCommonLoadStrategy)

    class WeightsOnly(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: Any) -> dict[str, Any]:
            path = Path(checkpoint_dir) / COMMON_STATE_FNAME
            return torch.load(path, map_location="cpu", weights_only=True)

    return WeightsOnly()


def _check_lora(backend: MegatronBackend, ckpt_dir: Path, saved: dict[str, Any] | None) -> None:
    """Refuse a resume under other adapters than the checkpoint's (or LoRA on one side only),
    naming the flags that match it."""
    from rltool.train.lora import read_adapter

    if saved is None and backend.lora is None:
        return
    if saved is None:
        raise CheckpointError(f"{ckpt_dir} was trained without LoRA; to train adapters on its "
                              f"weights, --load {ckpt_dir / ckpt.MODEL_DIR} (fresh optimizer)")
    if backend.lora is None:
        raise CheckpointError(f"{ckpt_dir} holds LoRA adapters; resume with --lora-rank "
                              f"{saved['rank']} --lora-alpha {saved['alpha']} "
                              f"--lora-target-modules {','.join(saved['targets'])}")
    adapter = ckpt_dir / ckpt.ADAPTER_DIR
    backend.lora.check_config(read_adapter(adapter)[0], where=adapter,
                              base_model_dir=backend.model_dir)


def load_checkpoint(backend: MegatronBackend, ckpt_dir: Path
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Restore model, optimizer, RNG and schedule position from a megatron trainer checkpoint;
    return the stage's state and tensors."""
    from megatron.core import dist_checkpointing

    from rltool.convert.torch_dist import check_storage_files
    from rltool.train.megatron_lora import is_adapter_key

    assert backend.optimizer is not None
    state = ckpt.read_trainer_state(ckpt_dir)
    written = state["backend"]
    if written.get("name") != "megatron":
        raise CheckpointError(f"{ckpt_dir} was written by the {written.get('name')} backend; to "
                              f"start megatron from its weights, --load {ckpt_dir / ckpt.MODEL_DIR}"
                              " (fresh optimizer)")
    _check_lora(backend, ckpt_dir, written.get("lora"))
    mine = _layout(backend)
    differ = [k for k in mine if k != "lora" and written.get(k) != mine[k]]
    if differ:
        raise CheckpointError(
            f"{ckpt_dir} was written with {differ[0]} = {written.get(differ[0])}, this run has "
            f"{mine[differ[0]]}; resume with the same layout, or --load "
            f"{ckpt_dir / ckpt.MODEL_DIR} (weights only, fresh optimizer)")
    source = ckpt_dir / ckpt.DIST_DIR
    check_storage_files(source)
    sharded = _sharded_state(backend, loading=True)
    loaded = dist_checkpointing.load(sharded, str(source),
                                     common_strategy=_weights_only_common_strategy())
    if backend.lora is None:
        backend.module.load_state_dict(loaded["model"])
    else:  # the adapters only: the base came from the adapter's base model directory
        result = backend.module.load_state_dict(loaded["model"], strict=False)
        assert not result.unexpected_keys and not any(
            is_adapter_key(k) for k in result.missing_keys), result
    with torch.no_grad():  # fp32 distributed-optimizer shards are views of the model parameters
        backend.optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(backend.optimizer)
    backend.optimizer_steps = int(written["optimizer_steps"])
    rng = ckpt.read_tensors(ckpt_dir / ckpt.RNG_FILE)
    rank = dist.get_rank()
    torch.set_rng_state(rng[f"torch_cpu/rank{rank}"])
    if torch.cuda.is_available() and f"torch_cuda/rank{rank}" in rng:
        torch.cuda.set_rng_state(rng[f"torch_cuda/rank{rank}"])
    return state, ckpt.read_tensors(ckpt_dir / ckpt.DATA_FILE)
