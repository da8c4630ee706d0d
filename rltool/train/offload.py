"""Moving a resident trainer off its device and back, for engine/trainer alternation on one GPU.

`Offloader(module, optimizer, params=...)` moves the optimizer state, and the parameters unless
`params` is False (they then stay on the device: `[loop] offload = "optimizer"`,
rltool.train.memplan), to host memory (`offload`) and back (`reload`). Gradients are freed, not
moved: an offload follows an optimizer step, and the next step starts from
`zero_grad(set_to_none=True)`. The Parameter objects stay the same (only their `.data` changes),
so the optimizer's references, hooks and the module's structure survive; the host buffers are
allocated once (pinned when CUDA is present) and reused by every later offload, so a run does not
fault in fresh host memory each step. Both directions are bit-exact copies.

On a CPU-only machine the device is the host, so the loop never calls it there; the calls still
work (fresh buffers on the way back) and the CPU tests check the bookkeeping with them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class Move:
    """One offload or reload: tensors and bytes moved, seconds, the device's allocated bytes
    after it (None on CPU), bytes moved by kind ("params", "optimizer") and gradient bytes freed."""

    tensors: int
    bytes: int
    seconds: float
    device_allocated_after: int | None
    moved: dict[str, int] = field(default_factory=dict)
    grads_freed: int = 0


class Offloader:
    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, params: bool = True):
        self.module, self.optimizer, self.params = module, optimizer, params
        self.device: torch.device | None = None  # where the tensors live while loaded
        self.offloaded = False
        self._host: dict[tuple[str, str], torch.Tensor] = {}

    def _slots(self) -> Iterator[tuple[tuple[str, str], torch.Tensor, object]]:
        """(key, tensor, setter) for every tensor that moves."""
        if self.params:
            for name, p in self.module.named_parameters():
                yield (name, "param"), p.data, lambda t, p=p: setattr(p, "data", t)
        if self.optimizer is None:
            return
        names = {id(p): n for n, p in self.module.named_parameters()}
        for p, state in self.optimizer.state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    yield (names[id(p)], f"opt.{k}"), v, lambda t, s=state, k=k: s.__setitem__(k, t)

    def _buffer(self, key: tuple[str, str], like: torch.Tensor) -> torch.Tensor:
        buf = self._host.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype,
                              pin_memory=torch.cuda.is_available() and like.is_cuda)
            self._host[key] = buf
        return buf

    def offload(self) -> Move:
        """The moving tensors to host memory, the gradients freed; the device copies are
        released."""
        if self.offloaded:
            raise RuntimeError("offload twice without a reload in between")
        t0 = time.perf_counter()
        self.device = next(self.module.parameters()).device
        freed = 0
        for p in self.module.parameters():
            if p.grad is not None:
                freed += _nbytes(p.grad)
                p.grad = None
        moved: dict[str, int] = {}
        for key, tensor, put in list(self._slots()):
            host = self._buffer(key, tensor)
            host.copy_(tensor, non_blocking=True)
            put(host)
            _count(moved, key, tensor)
        return self._finish(moved, t0, offloaded=True, grads_freed=freed)

    def reload(self) -> Move:
        """The moved tensors back to the device they came from."""
        if not self.offloaded:
            raise RuntimeError("reload without an offload")
        t0 = time.perf_counter()
        moved: dict[str, int] = {}
        for key, host, put in list(self._slots()):
            put(host.to(self.device, non_blocking=True, copy=True))
            _count(moved, key, host)
        return self._finish(moved, t0, offloaded=False)

    def _finish(self, moved: dict[str, int], t0: float, *, offloaded: bool,
                grads_freed: int = 0) -> Move:
        allocated = None
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if offloaded:
                torch.cuda.empty_cache()
            allocated = torch.cuda.memory_allocated(self.device)
        self.offloaded = offloaded
        return Move(tensors=moved.pop("tensors", 0), bytes=sum(moved.values()),
                    seconds=time.perf_counter() - t0, device_allocated_after=allocated,
                    moved=moved, grads_freed=grads_freed)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _count(moved: dict[str, int], key: tuple[str, str], t: torch.Tensor) -> None:
    kind = "params" if key[1] == "param" else "optimizer"
    moved[kind] = moved.get(kind, 0) + _nbytes(t)
    moved["tensors"] = moved.get("tensors", 0) + 1
