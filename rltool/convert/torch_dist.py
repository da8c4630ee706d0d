"""HF safetensors <-> megatron-core torch_dist checkpoints (Megatron-LM directory layout).

hf-to-dist builds this rank's megatron-core GPTModel (uninitialized weights), fills every tensor of
its sharded state dict from the HF tensors (read one at a time, each megatron slot fused and sliced
to this rank's shard), and saves with `dist_checkpointing.save` into `OUT/release/` (with the
training arguments Megatron-LM's loader reads in its common state), then writes the tracker
`OUT/latest_checkpointed_iteration.txt` = `release`. Under torchrun each rank fills and saves its
own shards; in one process the saved global tensors are the same, because torch_dist stores global
tensors and is resharded on load. Only the vocabulary padding (a multiple of
--make-vocab-size-divisible-by * TP; the padding rows are zeros) and the recorded args depend on
--tp/--pp/--ep.

dist-to-hf reads the global shapes from the checkpoint's metadata, builds a one-process model of
that shape, loads it, and writes the HF tensors back (exact inverse: HF -> dist -> HF is bit-exact).
torch_dist metadata is pickled by torch.distributed.checkpoint itself, so rltool reads such
checkpoints only from paths the user names.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from rltool import atomic
from rltool.config import DTYPE_ALIASES, StageConfig, torch_dtype_name, write_resolved
from rltool.convert import hf_writer, megatron_layout, name_map
from rltool.io import checkpoint as ckpt_io
from rltool.io import header as st
from rltool.io import reader as st_read
from rltool.convert.gpt_model import build_gpt_model, hf_arch, padded_vocab_size
from rltool.errors import CheckpointError
from rltool.progress import Progress

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

TRACKER_FILE = megatron_layout.TRACKER_FILE


class HfToDistConfig(StageConfig):
    """`rltool convert hf-to-dist`: HF safetensors -> torch_dist for megatron-core."""

    hf: Path = Field(description="Source HF checkpoint directory (llama, qwen2, qwen3, qwen3_moe).")
    out: Path = Field(description="New output directory (Megatron-LM layout).")
    tp: int = Field(default=1, ge=1, description="Tensor-parallel size (sets vocabulary padding).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel size.")
    ep: int = Field(default=1, ge=1, description="Expert-parallel size (MoE).")
    dtype: Annotated[Literal["auto", "fp32", "bf16", "fp16"], DTYPE_ALIASES] = Field(
        default="auto", description="Weight dtype in the checkpoint; auto keeps the HF dtype.")
    make_vocab_size_divisible_by: int = Field(
        default=128, ge=1,
        description="Pad the vocabulary to a multiple of this times --tp, as Megatron-LM's option "
                    "of the same name does; the padding rows are zeros.")


class DistToHfConfig(StageConfig):
    """`rltool convert dist-to-hf`: torch_dist -> HF safetensors."""

    dist: Path = Field(description="torch_dist checkpoint: the Megatron-LM root, or its release/ "
                                   "or iter_* directory.")
    hf_config: Path = Field(description="HF directory with the config.json (and tokenizer) to use.")
    out: Path = Field(description="New output directory.")
    workers: int = Field(default=2, ge=1, description="Writer threads.")
    max_shard_mb: float = Field(default=5000.0, gt=0, description="Largest output shard, in MB.")


def sharded_tensors(sharded_state_dict: dict[str, Any]) -> dict[name_map.Slot, list[Any]]:
    """Group this rank's ShardedTensors by slot (key, prepended layer/expert indices)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded_state_dict)
    slots: dict[name_map.Slot, list[Any]] = defaultdict(list)
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor):
            p = value.prepend_axis_num
            slots[(value.key, tuple(value.global_offset[:p]))].append(value)
    return slots


def shard_region(sh: Any) -> tuple[slice, ...]:
    p = sh.prepend_axis_num
    return tuple(slice(o, o + n) for o, n in zip(sh.global_offset[p:], sh.local_shape,
                                                  strict=True))


def _fill_from_hf(slots: dict[name_map.Slot, list[Any]], tensors: dict[str, st.TensorInfo], *,
                  hf_config: dict[str, Any], padded_vocab: int) -> None:
    """Fill every ShardedTensor for saving (the model's own parameters may stay unfilled)."""
    import torch

    shapes = name_map.Shapes.from_hf(hf_config)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    progress = Progress("convert: fill megatron shards", total=len(slots), unit="tensors")
    for (key, index), shards in progress.track(slots.items()):
        names = name_map.hf_names(key, index, tied=tied)  # raises for an unmapped key
        kind = name_map.RULES[key][0]
        dtype = shards[0].data.dtype
        hf = [st_read.read_tensor(tensors[n]).to(dtype) for n in names]
        if kind == "vocab":  # the largest tensors: copy rows into the shards, skip the padded copy
            _copy_vocab_rows(shards, hf[0], padded_vocab=padded_vocab)
            continue
        full = name_map.to_megatron(kind, hf, shapes=shapes, padded_vocab=padded_vocab)
        del hf
        expect = tuple(shards[0].global_shape[shards[0].prepend_axis_num:])
        if tuple(full.shape) != expect:
            raise CheckpointError(f"{key}{list(index)} from {', '.join(names)} has shape "
                                  f"{list(full.shape)}, the model expects {list(expect)}")
        released = []
        for sh in shards:
            if sh.data.untyped_storage().nbytes() != sh.data.nbytes:
                # A view into a parameter (fc1's gate/up halves): megatron's writer would clone it
                # while saving. Give it its own storage and free the parameter's (the model is
                # only a source of sharding metadata here), so no weight is held twice.
                released.append(sh.data.untyped_storage())
                sh.data = torch.empty_like(sh.data)
            sh.data.copy_(full[shard_region(sh)])
        for storage in released:
            storage.resize_(0)
        del full


def _copy_vocab_rows(shards: list[Any], weight: torch.Tensor, *, padded_vocab: int) -> None:
    """Fill vocabulary-sharded tensors from the unpadded HF rows; padding rows become zeros."""
    if shards[0].global_shape[0] != padded_vocab or shards[0].global_shape[1:] != weight.shape[1:]:
        raise CheckpointError(f"{shards[0].key}: HF rows {list(weight.shape)} do not fit the "
                              f"model's {list(shards[0].global_shape)}")
    for sh in shards:
        start, rows = sh.global_offset[0], sh.local_shape[0]
        real = max(0, min(rows, weight.shape[0] - start))
        sh.data[:real].copy_(weight[start:start + real])
        sh.data[real:].zero_()


def _hf_dtype(tensors: dict[str, st.TensorInfo], requested: str) -> torch.dtype:
    import torch

    if requested != "auto":
        return getattr(torch, torch_dtype_name(requested))
    return st.torch_dtype(tensors["model.embed_tokens.weight"].dtype)


def _rank0_tempdir(out: Path) -> Path:
    """A temporary directory next to `out`, created by rank 0 and known to every rank."""
    import torch.distributed as dist

    holder = [None]
    if dist.get_rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        holder[0] = tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def _build_fill_save(cfg: HfToDistConfig, out: Path, hf_config: dict[str, Any],
                     tensors: dict[str, st.TensorInfo], dtype: torch.dtype, *,
                     sizes: dict[str, int]) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    padded = padded_vocab_size(hf_config["vocab_size"], tp=cfg.tp,
                               divisible_by=cfg.make_vocab_size_divisible_by)
    model = build_gpt_model(hf_config, **sizes, params_dtype=dtype, vocab_size=padded,
                            perform_initialization=False)
    sharded = model.sharded_state_dict()
    with torch.no_grad():
        _fill_from_hf(sharded_tensors(sharded), tensors, hf_config=hf_config,
                      padded_vocab=padded)
    tmp = _rank0_tempdir(out)
    rank0 = dist.get_rank() == 0
    args = megatron_layout.checkpoint_args(hf_config, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep,
                                           padded_vocab=padded,
                                           divisible_by=cfg.make_vocab_size_divisible_by)
    release = megatron_layout.RELEASE
    try:
        if rank0:
            (tmp / release).mkdir()
        dist.barrier()
        dist_checkpointing.save({"model": sharded, "args": args, "iteration": 0,
                                 "checkpoint_version": megatron_layout.CHECKPOINT_VERSION},
                                str(tmp / release))
        dist.barrier()
        if rank0:
            write_resolved(cfg, tmp / hf_writer.RESOLVED_CONFIG)
            atomic.write_text(tmp / TRACKER_FILE, release)  # written last: the layout's marker
            os.rename(tmp, out)
            atomic.fsync_dir(out.parent)
    except BaseException:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()


def hf_to_dist(cfg: HfToDistConfig) -> dict[str, Any]:
    """Convert `cfg.hf` to a torch_dist checkpoint at `cfg.out`; every rank of the job calls this."""
    from rltool import megatron_compat

    started = time.perf_counter()
    out = hf_writer.check_new_output(cfg.out)
    hf_config = hf_writer.read_config(cfg.hf)
    hf_arch(hf_config)
    tensors = ckpt_io.checkpoint_tensors(cfg.hf)
    name_map.check_hf_tensors({n: i.shape for n, i in tensors.items()}, hf_config)
    dtype = _hf_dtype(tensors, cfg.dtype)
    megatron_compat.require_megatron()  # after the input checks: its import is noisy
    hf_writer.limit_heap_retention()
    # One process (not under torchrun) writes the same global tensors as a tp*pp*ep job would:
    # build an unsplit model and pad the vocabulary for cfg.tp.
    sizes = (dict(tp=cfg.tp, pp=cfg.pp, ep=cfg.ep) if int(os.environ.get("WORLD_SIZE", "1")) > 1
             else dict(tp=1, pp=1, ep=1))
    with megatron_compat.distributed(**sizes):
        _build_fill_save(cfg, out, hf_config, tensors, dtype, sizes=sizes)
    padded = padded_vocab_size(hf_config["vocab_size"], tp=cfg.tp,
                               divisible_by=cfg.make_vocab_size_divisible_by)
    return {"out": str(out), "arch": hf_config["model_type"], "tp": cfg.tp, "pp": cfg.pp,
            "ep": cfg.ep, "padded_vocab_size": padded, "dtype": str(dtype).removeprefix("torch."),
            "tensors": len(tensors), "seconds": round(time.perf_counter() - started, 3)}


def iteration_dir(dist_dir: str | os.PathLike) -> Path:
    """Resolve a Megatron-LM root (via its tracker file) or a release/iteration directory itself."""
    path = Path(dist_dir)
    if (path / TRACKER_FILE).exists():
        path = megatron_layout.resolve_root(path)
    if not (path / ".metadata").exists():
        raise CheckpointError(f"{dist_dir} is not a torch_dist checkpoint (no {TRACKER_FILE} and "
                              "no .metadata); pass the directory hf-to-dist wrote")
    check_storage_files(path)
    return path


def check_storage_files(iteration: Path) -> None:
    """Refuse a checkpoint whose metadata names a data file outside its directory (an absolute
    path, `..`, a link leading out): torch would read it as this checkpoint's tensors."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(iteration)).read_metadata()
    except Exception as e:  # torch raises anything for a corrupt .metadata
        raise CheckpointError(f"{iteration}/.metadata is unreadable ({e}); pass the directory "
                              "hf-to-dist wrote") from e
    names = {getattr(info, "relative_path", None)
             for info in (getattr(metadata, "storage_data", None) or {}).values()}
    for name in sorted(names, key=str):
        ckpt_io.check_name(iteration, name, what=f"{iteration}/.metadata")


def _check_against_metadata(slots: dict[name_map.Slot, list[Any]], metadata: dict[str, Any]) -> None:
    keys = {key for key, _ in slots}
    missing = sorted(keys - set(metadata))
    if missing:
        raise CheckpointError(f"torch_dist checkpoint lacks {', '.join(missing[:3])}; was it "
                              "written for another --hf-config?")
    for (key, _), shards in slots.items():
        if tuple(shards[0].global_shape) != tuple(metadata[key].global_shape):
            raise CheckpointError(f"{key} is {list(metadata[key].global_shape)} in the checkpoint, "
                                  f"{list(shards[0].global_shape)} for this --hf-config")


def _copy_loaded(sharded: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Make sure every ShardedTensor's data holds what `dist_checkpointing.load` returned: it loads
    in place when it can; copy where it returned a different tensor (matched by key, since the
    returned dict's order differs)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for name, value in sharded.items():
        pairs = (zip(value, loaded[name], strict=True) if isinstance(value, list)
                 else [(value, loaded[name])])
        for sh, got in pairs:
            if isinstance(sh, ShardedTensor) and got.data_ptr() != sh.data.data_ptr():
                sh.data.copy_(got)


def _split_job(key: str, shards: list[Any], shapes: name_map.Shapes) -> Any:
    """A writer job body: assemble the slot's global tensor from its shards, split it into HF."""
    def run() -> list[torch.Tensor]:
        import torch

        first = shards[0]
        full = first.data.new_empty(first.global_shape[first.prepend_axis_num:])
        with torch.no_grad():
            for sh in shards:
                full[shard_region(sh)] = sh.data.reshape(sh.local_shape)
        return name_map.to_hf(name_map.RULES[key][0], full, shapes=shapes)

    return run


def _weights_only_common_strategy() -> Any:
    """megatron-core's common-state loader, minus `common.pt`: rltool needs the weights only, and
    common.pt is a pickle (a Megatron-LM run's args hold classes torch's safe loader refuses)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class WeightsOnly(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: Any) -> dict[str, Any]:
            return {}

    return WeightsOnly()


def load_model_weights(model: Any, dist_dir: str | os.PathLike) -> dict[name_map.Slot, list[Any]]:
    """Load a torch_dist checkpoint (root, release/ or iter_* dir) into this rank's GPTModel,
    in place.

    Refuses, before loading, a checkpoint whose tensors are missing or shaped for another config.
    Returns the model's ShardedTensors by slot (their data are the model's parameters).
    """
    import torch
    from megatron.core import dist_checkpointing

    source = iteration_dir(dist_dir)
    sharded = model.sharded_state_dict()
    slots = sharded_tensors(sharded)
    _check_against_metadata(slots, dist_checkpointing.load_tensors_metadata(str(source)))
    loaded = dist_checkpointing.load({"model": sharded}, str(source),
                                     common_strategy=_weights_only_common_strategy())
    with torch.no_grad():
        _copy_loaded(sharded, loaded["model"])
    return slots


def load_hf_weights(model: Any, hf_dir: str | os.PathLike) -> dict[name_map.Slot, list[Any]]:
    """Fill this rank's GPTModel, in place, from an HF checkpoint directory (each parameter gets
    its shard of the fused, padded megatron tensor; the vocabulary padding rows are zeros).
    Refuses a checkpoint whose tensors do not match its config.json. Returns the ShardedTensors by
    slot, as `load_model_weights` does."""
    import torch

    hf_config = hf_writer.read_config(Path(hf_dir))
    tensors = ckpt_io.checkpoint_tensors(Path(hf_dir))
    name_map.check_hf_tensors({n: i.shape for n, i in tensors.items()}, hf_config)
    shapes = name_map.Shapes.from_hf(hf_config)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    slots = sharded_tensors(model.sharded_state_dict())
    with torch.no_grad():
        for (key, index), shards in slots.items():
            hf = [st_read.read_tensor(tensors[n]) for n in name_map.hf_names(key, index, tied=tied)]
            full = name_map.to_megatron(name_map.RULES[key][0], hf, shapes=shapes,
                                        padded_vocab=shards[0].global_shape[0])
            for sh in shards:  # views of the parameters: copying into them fills the model
                sh.data.copy_(full[shard_region(sh)].reshape(sh.data.shape))
    return slots


def _read_dist(source: Path, hf_config: dict[str, Any]) -> tuple[Any, dict[name_map.Slot, list]]:
    """Build a one-process GPTModel shaped like the checkpoint and load it: (dtype, slots)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if dist.get_world_size() != 1:
        raise CheckpointError("dist-to-hf runs as one process; launch it without torchrun")
    metadata = dist_checkpointing.load_tensors_metadata(str(source))
    embedding = metadata.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise CheckpointError(f"{source} holds no embedding.word_embeddings.weight")
    # the padded vocabulary (it depends on the TP the checkpoint was written for) comes from it
    model = build_gpt_model(hf_config, params_dtype=embedding.dtype,
                            vocab_size=embedding.global_shape[0], perform_initialization=False)
    return embedding.dtype, load_model_weights(model, source)


def dist_to_hf(cfg: DistToHfConfig) -> dict[str, Any]:
    """Convert a torch_dist checkpoint back to HF safetensors at `cfg.out` (one process)."""
    from rltool import megatron_compat

    started = time.perf_counter()
    out = hf_writer.check_new_output(cfg.out)
    hf_config = hf_writer.read_config(cfg.hf_config)
    hf_arch(hf_config)
    source = iteration_dir(cfg.dist)
    megatron_compat.require_megatron()  # after the input checks: its import is noisy
    hf_writer.limit_heap_retention()
    with megatron_compat.distributed():
        dtype, slots = _read_dist(source, hf_config)
    shapes = name_map.Shapes.from_hf(hf_config)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    expected = name_map.expected_hf_shapes(hf_config)
    code = st.dtype_code(dtype)
    jobs = [hf_writer.Job(outputs=[(n, code, expected[n]) for n in name_map.hf_names(key, index)],
                          run=_split_job(key, shards, shapes))
            for (key, index), shards in slots.items()
            if not (key == "output_layer.weight" and tied)]
    config = dict(hf_config)
    for k in ("torch_dtype", "dtype"):
        if k in config:
            config[k] = str(dtype).removeprefix("torch.")
    written = hf_writer.publish_checkpoint(out, jobs, config=config,
                                           side_files_from=cfg.hf_config, stage_config=cfg,
                                           workers=cfg.workers, max_shard_mb=cfg.max_shard_mb)
    return {"out": str(out), "source": str(source), "tensors": sum(len(j.outputs) for j in jobs),
            "bytes_out": written["total_size"], "files": written["files"],
            "seconds": round(time.perf_counter() - started, 3)}
