"""The live weights of a module as the backuper sees them: its parameters' tensors by name (local
shards under FSDP2), a cheap content fingerprint computed where they live, and the mapping of a
full tensor onto this rank's shard."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """A cheap content fingerprint of live tensors, computed where they live: xxh3 over the bytes
    on the host; on CUDA a position-weighted integer sum on the device (no transfer)."""
    import xxhash

    host = xxhash.xxh3_128()
    device_sums = []
    for t in tensors:
        if t.device.type == "cpu":
            host.update(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))
            continue
        flat = t.detach().contiguous().view(-1)
        ints = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                          8: torch.int64}[flat.element_size()])
        chunk = 1 << 24
        for start in range(0, ints.numel(), chunk):
            part = ints[start:start + chunk].to(torch.int64)
            weights = torch.arange(start + 1, start + 1 + part.numel(), device=t.device,
                                   dtype=torch.int64) * 0x9E3779B1
            device_sums.append((part * weights).sum())
    if device_sums:
        host.update(repr([int(s) for s in torch.stack(device_sums).tolist()]).encode())
    return host.hexdigest()


def module_tensors(module: torch.nn.Module, *,
                   exclude_prefixes: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The live tensors of a module's parameters, by name (tied parameters once): the local
    shard of a DTensor (FSDP2), else the parameter's data."""
    out = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith(exclude_prefixes):
                continue
            out[name] = p.to_local() if hasattr(p, "to_local") else p.data
    return out


def dtensor_sharder(module: torch.nn.Module) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
    """For FSDP2 modules: full tensor -> this rank's local shard (no communication)."""
    params = dict(module.named_parameters())
    if not any(hasattr(p, "device_mesh") for p in params.values()):
        return None
    from torch.distributed.tensor import distribute_tensor

    def shard(name: str, full: torch.Tensor) -> torch.Tensor:
        p = params[name]
        if not hasattr(p, "device_mesh"):
            return full
        return distribute_tensor(full.to(p.device, p.dtype), p.device_mesh, p.placements,
                                 src_data_rank=None).to_local()

    return shard


def fsdp_resharder(module: torch.nn.Module) -> Callable[[], None] | None:
    """For FSDP2 modules: a callable that reshards every unit, so the next forward all-gathers
    from the (just restored) sharded parameters. Without it, units that stay unsharded between
    passes (FSDP2 keeps the root's parameters gathered after a forward) would run on stale
    copies of the previous weights."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        return None

    def reshard() -> None:
        for unit in units:
            unit.reshard()

    return reshard
