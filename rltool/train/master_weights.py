"""The torch backend's optimizer with master weights of its own: `--param-dtype bf16` (bf16
parameters, fp32 main gradients and fp32 masters) and `--optimizer-cpu-offload` (the masters,
AdamW's moments and the step in host memory).

- Masters: an fp32 copy of every parameter, made from the checkpoint's fp32 values before the
  module is cast (so bf16 parameters lose nothing at load), on the parameters' device, or in
  host memory (pinned on CUDA hosts) with the offload. AdamW steps the masters; after each step
  they are copied into the parameters (cast to bf16, or plain copies of fp32 parameters).
- Main gradients: with bf16 parameters a hook on each parameter (`register_post_accumulate_
  grad_hook`) adds the bf16 gradient of every backward pass into an fp32 buffer and frees it,
  so micro-batches accumulate in fp32 as megatron's `main_grad` does; fp32 parameters' own
  gradients are their main gradients. With the offload the main gradients are copied to host
  buffers (allocated once) before the step.
- Clipping: the global norm of the main gradients (torch's `get_total_norm`), then the masters'
  gradients scaled as `clip_grad_norm_` does (`clip_grads_with_norm_`). With fp32 parameters
  every operation is the plain path's on the same values, so the offloaded step is bit-identical
  to it (tests/train/test_optimizer_offload.py).
- State by parameter name, in the layout `get_optimizer_state_dict(full_state_dict=True)` gives
  the plain optimizer (rltool.train.checkpoint stores it unchanged): checkpoints move between
  this optimizer and the plain one. The masters are the checkpoint's weights.

One process (no DDP or FSDP), refused under torchrun by the backend.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from rltool.errors import ConfigError


class MasterWeights:
    """AdamW over fp32 masters of `named` parameters (see the module docstring); `host`: masters
    and optimizer state in host memory. `make_optimizer(masters)` builds the inner optimizer."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]],
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], *,
                 param_dtype: torch.dtype, host: bool, processes: int = 1):
        """`named`: the fp32 parameters, cast here to `param_dtype` once their masters exist;
        `processes`: the data-parallel ranks (one only)."""
        if processes > 1:
            raise ConfigError("--param-dtype bf16 and --optimizer-cpu-offload run in one process; "
                              "drop them under torchrun (or use --parallel fsdp --dtype bf16)")
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.host = host
        self._pin = host and torch.cuda.is_available()
        self.masters = [p.detach().to("cpu" if host else p.device, torch.float32, copy=True)
                        for p in self.params]
        if self._pin:
            self.masters = [m.pin_memory() for m in self.masters]
        self._host_grads: list[torch.Tensor | None] = [None] * len(self.params)
        self._main: dict[torch.nn.Parameter, torch.Tensor] = {}
        # The hook lives in the tensor's C++ autograd state, where the garbage collector cannot
        # see it: a hook holding this object would keep it (masters, moments) alive for good.
        me = weakref.ref(self)

        def accumulate(param: torch.nn.Parameter) -> None:
            if (optimizer := me()) is not None:  # gone: its gradients stay on the parameter
                optimizer._accumulate(param)

        for p in self.params:
            p.data = p.data.to(param_dtype)
            if param_dtype != torch.float32:
                p.register_post_accumulate_grad_hook(accumulate)
        self.optimizer = make_optimizer(self.masters)

    def _accumulate(self, param: torch.nn.Parameter) -> None:
        """A bf16 gradient into its fp32 main gradient (bf16 gradients never add up in bf16)."""
        main = self._main.get(param)
        if main is None:
            self._main[param] = param.grad.float()
        else:
            main.add_(param.grad)
        param.grad = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def main_grads(self) -> list[torch.Tensor | None]:
        return [self._main.get(p) if p.dtype != torch.float32 else p.grad for p in self.params]

    def clip_grad_norm(self, max_norm: float, *, foreach: bool | None) -> float:
        """Set the masters' gradients from the main gradients (host copies with the offload),
        clip them to `max_norm` by the main gradients' global norm; returns that norm."""
        grads = self.main_grads()
        for k, (master, grad) in enumerate(zip(self.masters, grads)):
            if grad is None:
                master.grad = None
            elif self.host:
                if self._host_grads[k] is None:
                    self._host_grads[k] = torch.empty(master.shape, dtype=torch.float32,
                                                      pin_memory=self._pin)
                master.grad = self._host_grads[k].copy_(grad, non_blocking=True)
            else:
                master.grad = grad
        present = [g for g in grads if g is not None]
        norm = torch.nn.utils.get_total_norm(present, foreach=foreach)
        if self.host and torch.cuda.is_available():
            torch.cuda.synchronize()  # the gradients' copies are on the host
        torch.nn.utils.clip_grads_with_norm_(self.masters, max_norm, norm.to(
            self.masters[0].device), foreach=foreach)
        return float(norm)

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        for p, master in zip(self.params, self.masters):
            p.copy_(master, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, master in zip(self.params, self.masters):
            p.grad = None
            master.grad = None
        self._main.clear()

    # -- state by name ---------------------------------------------------------------------------
    def with_masters(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A module state dict with each parameter's master in its place (tied names share)."""
        masters = {p.data_ptr(): m for p, m in zip(self.params, self.masters)}
        return {k: masters.get(v.data_ptr(), v) for k, v in state.items()}

    def state_dict(self) -> dict[str, Any]:
        """The layout of `get_optimizer_state_dict(..., full_state_dict=True)`: state and groups
        keyed by parameter name."""
        inner = self.optimizer.state_dict()
        index = {k: name for k, name in enumerate(self.names)}
        return {"state": {index[k]: dict(v) for k, v in inner["state"].items()},
                "param_groups": [dict(g, params=[index[k] for k in g["params"]])
                                 for g in inner["param_groups"]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = {name: k for k, name in enumerate(self.names)}
        missing = [name for g in state["param_groups"] for name in g["params"]
                   if name not in position]
        if missing:
            raise KeyError(f"optimizer state of unknown parameter {missing[0]!r}")
        self.optimizer.load_state_dict({
            "state": {position[name]: v for name, v in state["state"].items()},
            "param_groups": [dict(g, params=[position[n] for n in g["params"]])
                             for g in state["param_groups"]]})

    @torch.no_grad()
    def load_masters(self, tensors: dict[str, torch.Tensor]) -> None:
        """Masters (and parameters) from fp32 weights by name (a checkpoint's)."""
        for name, p, master in zip(self.names, self.params, self.masters):
            if name in tensors:
                master.copy_(tensors[name])
                p.copy_(master)
