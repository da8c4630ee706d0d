"""`--optimizer-cpu-offload` for the megatron backend: megatron-core's HybridDeviceOptimizer.

megatron-core 0.16 builds it when `OptimizerConfig.optimizer_cpu_offload` is set
(`get_megatron_optimizer`): the first `optimizer_offload_fraction` of the distributed optimizer's
parameter shards (by element count, whole tensors) get fp32 master copies in host memory and a
host torch AdamW (`fused=True`); each step copies their fp32 main-gradient shards to the host,
steps there and copies the updated parameters back, while the rest steps on the device as
before. It needs the distributed optimizer (the hybrid optimizer is built on its parameter
shards) and Adam (megatron's CPU optimizers are AdamW and SGD; rltool trains with Adam), and
rides on megatron's precision-aware optimizer path (`use_precision_aware_optimizer`: gradients
reach it as `decoupled_grad`, the master weights are its own), as Megatron-LM's
`--optimizer-cpu-offload` requires.

On a machine without CUDA (the tests) the hybrid optimizer has no device to offload from: its
streams are CUDA streams and it offloads only `is_cuda` tensors, so every parameter would stay
where it is and its step would look up host copies that were never made. `enable_cpu()` makes
the CPU stand in for the device: the offloaded fraction gets host copies exactly as CUDA
parameters would (the copy in, the step on the copies, the copy back), with streams that do
nothing (one device, one stream). And without transformer-engine (CPU or GPU) one version
check of megatron's OptimizerConfig fails (`_without_te`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

_LOCK = threading.Lock()
_ENABLED = False
_LEAVES = False
_GRADS = False
_LOAD = False


def optimizer_config(options: Any, *, cuda: bool) -> dict[str, Any]:
    """megatron OptimizerConfig fields of `--optimizer-cpu-offload` (empty when off)."""
    if not options.optimizer_cpu_offload:
        return {}
    _without_te()
    _fp32_shards_as_leaves()
    _device_fp32_grads()
    _fp32_masters_on_load()
    if not cuda:
        enable_cpu()
    return dict(optimizer_cpu_offload=True,
                optimizer_offload_fraction=options.optimizer_offload_fraction,
                use_precision_aware_optimizer=True,
                # pinned host buffers need a device; on the CPU the copies are plain memory
                pin_cpu_grads=cuda, pin_cpu_params=cuda)


class _Stream:
    """A CUDA stream's interface where there is one device and one stream: nothing to order."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self) -> _Stream:
        return self

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuCuda:
    current_stream = staticmethod(lambda device=None: _Stream())
    Stream = _Stream

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _CpuTorch:
    """`torch` as the hybrid optimizer's module sees it on the CPU: `torch.cuda` is _CpuCuda."""

    cuda = _CpuCuda

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


def _groups_on_cpu(self: Any, offload_fraction: float) -> tuple[Any, ...]:
    """HybridDeviceOptimizer._get_sub_optimizer_param_groups with the CPU as the device: the same
    split (the first parameters up to `offload_fraction` of the elements get host copies, the
    rest stay), made of copies instead of `.cpu().pin_memory()` moves."""
    import torch

    params = [p for group in self.param_groups for p in group["params"]]
    threshold = sum(p.numel() for p in params) * offload_fraction
    offloaded = 0
    cpu_groups, device_groups = [], []
    to_copy, to_param, to_fp32 = {}, {}, {}
    for group in self.param_groups:
        cpu_group, device_group = dict(group, params=[]), dict(group, params=[])
        for param in group["params"]:
            original, copied = param, offloaded < threshold
            if copied:
                param = param.detach().clone()
                offloaded += param.numel()
            if self.param_update_in_fp32 and param.dtype != torch.float32:
                param = param.detach().clone().float()
                to_fp32[original] = param
            if copied:
                to_copy[original], to_param[param] = param, original
                cpu_group["params"].append(param)
            else:
                device_group["params"].append(param)
        cpu_groups += [cpu_group] if cpu_group["params"] else []
        device_groups += [device_group] if device_group["params"] else []
    return cpu_groups, device_groups, to_copy, to_param, to_fp32


def _without_te() -> None:
    """OptimizerConfig's precision-aware check asks `is_te_min_version("2.1.0")`, which compares
    None with a version (TypeError) when transformer-engine is missing; without it the answer
    is False (no parameter remainders to store, as megatron then sets)."""
    from megatron.core import utils
    from megatron.core.optimizer import optimizer_config

    if utils.get_te_version() is None:
        optimizer_config.is_te_min_version = lambda *args, **kwargs: False


def _fp32_shards_as_leaves() -> None:
    """With fp32 parameters and the precision-aware path, the distributed optimizer hands its
    optimizer the shards of fp32 parameters as views of them (`model_param.view(-1)[a:b]`):
    non-leaf tensors, which the hybrid optimizer's constructor refuses ("can't optimize a
    non-leaf Tensor"; megatron's own Adam gets its groups assigned, unchecked). The same views,
    detached (same storage, same tensor-parallel attributes), are leaves; they replace the
    originals both in the optimizer's groups and in the shard lists that receive the gradients,
    so the two stay one set of tensors. bf16 shards are detached views already."""
    global _LEAVES
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    with _LOCK:
        if _LEAVES:
            return
        build = DistributedOptimizer._build_model_and_main_param_groups.__func__

        def build_leaves(cls: type, gbuf_ranges: Any, param_map: Any, opt_group_ranges: Any,
                         config: Any) -> Any:
            groups = build(cls, gbuf_ranges, param_map, opt_group_ranges, config)
            if not config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                return groups
            leaves: dict[int, Any] = {}
            for shard_group in groups[3]:  # shard_fp32_groups
                for i, view in enumerate(shard_group):
                    leaf = view.detach()
                    leaf.__dict__.update(view.__dict__)
                    leaves[id(view)] = shard_group[i] = leaf
            for group_range in opt_group_ranges:
                params = group_range["orig_group"]["params"]
                params[:] = [leaves.get(id(p), p) for p in params]
            return groups

        DistributedOptimizer._build_model_and_main_param_groups = classmethod(build_leaves)
        _LEAVES = True


def _device_fp32_grads() -> None:
    """The hybrid optimizer gives its device optimizer the gradients of the fp32 master copies it
    made for 16-bit parameters, and nothing for parameters that were fp32 already: those keep
    their gradient in `decoupled_grad` (the precision-aware path), where torch's AdamW does not
    look, so with fp32 parameters and a fraction below 1 the device part never stepped. Each
    such parameter's gradient is its `decoupled_grad` (the same tensor, no copy)."""
    global _GRADS
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    with _LOCK:
        if _GRADS:
            return
        original = HybridDeviceOptimizer._set_sub_optimizer_grads

        def set_grads(self: Any) -> None:
            if self.gpu_optimizer is not None:
                for group in self.gpu_optimizer.param_groups:
                    for param in group["params"]:
                        if param not in self.fp32_param_to_orig_param:
                            param.grad = getattr(param, "decoupled_grad", None)
            original(self)

        HybridDeviceOptimizer._set_sub_optimizer_grads = set_grads
        _GRADS = True


def _fp32_masters_on_load() -> None:
    """After a checkpoint load the hybrid optimizer copies each loaded master weight into the
    fp32 copy it made of a 16-bit parameter, and fails (KeyError) for a parameter that was fp32
    already and has none. The copy goes to the tensor the optimizer steps for each parameter:
    its fp32 copy, its host copy, or the parameter itself."""
    global _LOAD
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    def update_fp32_params_by_new_state(self: Any) -> None:
        if not self.param_update_in_fp32:
            return
        for param, state in self.state.items():
            inner = self.param_to_inner_param.get(param, param)
            master = state.get("master_param")
            if master is not None and master is not inner:
                inner.data.copy_(master)

    with _LOCK:
        if not _LOAD:
            HybridDeviceOptimizer._update_fp32_params_by_new_state = \
                update_fp32_params_by_new_state
            _LOAD = True


def enable_cpu() -> None:
    """The module docstring's CPU stand-in (idempotent; only where CUDA is absent)."""
    global _ENABLED
    import torch
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    if torch.cuda.is_available():
        return
    with _LOCK:
        if not _ENABLED:
            hybrid_optimizer.torch = _CpuTorch()
            hybrid_optimizer.HybridDeviceOptimizer._get_sub_optimizer_param_groups = _groups_on_cpu
            _ENABLED = True
