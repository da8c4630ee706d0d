"""What holds device memory after a test: the largest live tensors of a device and, for each, the
chain of Python objects that keeps it alive (attribute and key names), for the GPU suite's
release check to print beside its figure."""

from __future__ import annotations

import gc
import sys
import types
from typing import Any

import torch

SKIP_TYPES = (types.CellType, types.FrameType, types.FunctionType, types.MethodType,
              types.ModuleType)


def _unfreeze() -> None:
    # gc.get_objects and gc.get_referrers do not see objects frozen with gc.freeze (the session
    # freezes its imports' objects once collection ends: tests/conftest.py); a report unfreezes
    # them, and later collections walk them again.
    gc.unfreeze()


def live_tensors(device_type: str) -> list[tuple[int, torch.Tensor]]:
    """(storage bytes, tensor) of every gc-visible tensor on `device_type`, one per storage,
    largest first."""
    _unfreeze()
    seen: dict[int, tuple[int, torch.Tensor]] = {}
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor) or obj.device.type != device_type:
                continue
            storage = obj.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except Exception:  # noqa: BLE001 (any object of the process: fake, traced, torn down)
            continue
        if key and key not in seen:
            seen[key] = (nbytes, obj)
    return sorted(seen.values(), key=lambda item: -item[0])


def _edge(holder: Any, held: Any) -> str:
    """How `holder` refers to `held`: 'Owner.name', '[key]', '[i]' or the holder's type."""
    if isinstance(holder, dict):
        for key, value in holder.items():
            if value is held:
                return f"[{key!r}]"[:60]
    if isinstance(holder, (list, tuple)):
        for i, value in enumerate(holder):
            if value is held:
                return f"[{i}]"
    for name, value in getattr(holder, "__dict__", {}).items():
        if value is held:
            return f"{type(holder).__name__}.{name}"
    return f"<{type(holder).__name__}>"


def holder_chain(obj: Any, depth: int = 6, ignore: set[int] | None = None) -> str:
    """One path of referrers from `obj` outwards, e.g. "['kv'] <- Cache.buffers <- Engine.cache".

    An instance's __dict__ is folded into the instance ('Owner.attr'). Frames, cells and
    functions are not followed (the test's own locals are gone by teardown); `ignore`: ids of the
    caller's own containers."""
    _unfreeze()
    ignore = {id(sys._getframe()), *(ignore or ())}
    lists: list[list[Any]] = []  # this function's own lists, alive so that no id is reused

    def referrers(target: Any) -> list[Any]:
        found = gc.get_referrers(target)
        kept = [r for r in found if id(r) not in ignore and not isinstance(r, SKIP_TYPES)]
        lists.extend((found, kept))
        ignore.update((id(found), id(kept)))
        return kept

    parts, current = [], obj
    ignore.add(id(obj))
    for _ in range(depth):
        candidates = referrers(current)
        if not candidates:
            break
        holder = candidates[0]
        edge = _edge(holder, current)
        if isinstance(holder, dict):
            owner = next((o for o in referrers(holder)
                          if getattr(o, "__dict__", None) is holder), None)
            if owner is not None:
                ignore.add(id(holder))
                holder, edge = owner, _edge(owner, current)
        parts.append(edge)
        ignore.add(id(holder))
        current = holder
    return " <- ".join(parts) or "no Python referrer (held from C++: a graph pool, autograd)"


def describe(device_type: str, limit: int = 5) -> str:
    """The `limit` largest live tensors of `device_type` with their holder chains, one per line."""
    gc.collect()
    found = live_tensors(device_type)[:limit]
    own = {id(found), *(id(item) for item in found)}
    lines = []
    for nbytes, tensor in found:
        try:
            chain = holder_chain(tensor, ignore=own)
        except Exception as e:  # noqa: BLE001 (a report must not fail on an odd referrer)
            chain = f"(its holders could not be read: {type(e).__name__}: {e})"
        lines.append(f"{nbytes / 2**20:.1f} MiB {tuple(tensor.shape)} {tensor.dtype}: {chain}")
    return "\n".join(lines) or f"no gc-visible {device_type} tensor"
