"""Moving a resident trainer off its device and back, for engine/trainer alternation on one GPU.

`Offloader(module, optimizer)` moves every parameter, gradient and optimizer-state tensor to host
memory (`offload`) and back (`reload`). The Parameter objects stay the same (only their `.data`
changes), so the optimizer's references, hooks and the module's structure survive; the host
buffers are allocated once (pinned when CUDA is present) and reused by every later offload, so
a run does not fault in fresh host memory each step. Both directions are bit-exact copies.

On a CPU-only machine the device is the host, so the loop never calls it there; the calls still
work (fresh buffers on the way back) and the CPU tests check the bookkeeping with them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class Move:
    """One offload or reload: tensors and bytes moved, seconds, and the device's allocated
    bytes after it (None on CPU)."""

    tensors: int
    bytes: int
    seconds: float
    device_allocated_after: int | None


class Offloader:
    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.module, self.optimizer = module, optimizer
        self.device: torch.device | None = None  # where the tensors live while loaded
        self.offloaded = False
        self._host: dict[tuple[str, str], torch.Tensor] = {}

    def _slots(self) -> Iterator[tuple[tuple[str, str], torch.Tensor, object]]:
        """(key, tensor, setter) for every tensor that lives on the device."""
        for name, p in self.module.named_parameters():
            yield (name, "param"), p.data, lambda t, p=p: setattr(p, "data", t)
            if p.grad is not None:
                yield (name, "grad"), p.grad, lambda t, p=p: setattr(p, "grad", t)
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
        """Everything to host memory; the device copies are released."""
        if self.offloaded:
            raise RuntimeError("offload twice without a reload in between")
        t0 = time.perf_counter()
        count = nbytes = 0
        for key, tensor, put in list(self._slots()):
            self.device = tensor.device
            host = self._buffer(key, tensor)
            host.copy_(tensor, non_blocking=True)
            put(host)
            count, nbytes = count + 1, nbytes + tensor.numel() * tensor.element_size()
        return self._finish(count, nbytes, t0, offloaded=True)

    def reload(self) -> Move:
        """Everything back to the device it came from."""
        if not self.offloaded:
            raise RuntimeError("reload without an offload")
        t0 = time.perf_counter()
        count = nbytes = 0
        for _, host, put in list(self._slots()):
            put(host.to(self.device, non_blocking=True, copy=True))
            count, nbytes = count + 1, nbytes + host.numel() * host.element_size()
        return self._finish(count, nbytes, t0, offloaded=False)

    def _finish(self, count: int, nbytes: int, t0: float, *, offloaded: bool) -> Move:
        allocated = None
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if offloaded:
                torch.cuda.empty_cache()
            allocated = torch.cuda.memory_allocated(self.device)
        self.offloaded = offloaded
        return Move(tensors=count, bytes=nbytes, seconds=time.perf_counter() - t0,
                    device_allocated_after=allocated)
