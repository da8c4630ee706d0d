"""Run the train stage in several processes: `rltool train --nproc-per-node N` re-launches itself
under torchrun with the resolved config, so every rank sees exactly the same TrainConfig."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rltool.train.config import TrainConfig


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_command(config_file: Path, *, nproc_per_node: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc_per_node}", "-m", "rltool", "train", "--config",
            str(config_file), *extra]


def launch(cfg: TrainConfig, *, nproc_per_node: int, extra_args: list[str] | None = None) -> int:
    """Run `cfg` under torchrun with `nproc_per_node` processes; returns the exit code of rank 0's
    launcher (the first failing rank's code when one fails)."""
    import tomli_w

    with tempfile.TemporaryDirectory(prefix="rltool-train-") as tmp:
        config_file = Path(tmp) / "train.toml"
        config_file.write_text(tomli_w.dumps({"train": cfg.model_dump(mode="json",
                                                                      exclude_none=True)}))
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = torchrun_command(config_file, nproc_per_node=nproc_per_node,
                               extra=list(extra_args or []))
        return subprocess.run(cmd, env=env, check=False).returncode


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def process_group_scope() -> Iterator[None]:
    """A block whose ranks may join the torchrun process group: when the group started inside
    the block, it ends with the block (threads included, see `destroy_process_groups`)."""
    import torch.distributed as dist

    owns_group = not dist.is_initialized()
    try:
        yield
    finally:
        if owns_group and dist.is_initialized():
            destroy_process_groups()


def destroy_process_groups() -> None:
    """Destroy every process group and drop what still holds one. `destroy_process_group` only
    unregisters the groups: megatron's model-parallel state and FSDP2's DeviceMesh, which DTensor
    keeps in its sharding-propagation and redistribution caches, still reference them, so their
    gloo worker threads would run on into interpreter shutdown. There a worker that releases a
    finished collective's tensors needs the GIL, Python ends the thread inside a C++ destructor,
    and the rank aborts: "terminate called without an active exception". Unreferenced, the
    groups join their threads here, while the interpreter is whole."""
    import sys

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    gc.collect()  # the models and optimizers that referenced a mesh sit in reference cycles
    for obj in gc.get_objects():  # the meshes the caches keep: release their groups
        if type(obj) is DeviceMesh:
            obj._pg_registry.clear()


def init_distributed(device: str = "auto") -> tuple[int, int, Any]:
    """(rank, world size, device) of the torch backend; joins the torchrun process group when
    WORLD_SIZE > 1. device: "auto" (CUDA when available), "cpu" or "cuda"."""
    import torch
    import torch.distributed as dist

    from rltool.errors import ConfigError

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is visible; use --device auto or cpu")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")
