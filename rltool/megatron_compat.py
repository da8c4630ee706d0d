"""The one place where megatron-core is adapted to run on CPU with gloo (tests, CI, conversion).

megatron-core 0.16 assumes CUDA in a few spots that conversion and CPU tests reach. On a machine
without CUDA, `enable_cpu()` patches exactly these, and nothing when CUDA is available:

- `torch.cuda.current_device()`: megatron moves buffers to it (e.g. the rotary `inv_freq`, pipeline
  receive buffers); on CPU it returns `torch.device("cpu")`, so `.to(device=...)` and
  `torch.empty(..., device=...)` land on the CPU.
- `torch.cuda.synchronize()`: called after barriers; a no-op on CPU.
- `get_default_causal_mask` (transformer.utils, imported by fusions.fused_softmax): builds the
  causal mask with a hard-coded `device="cuda"`; replaced by the same mask on the CPU.
- `moe_utils.te_general_gemm`: left undefined when transformer-engine is missing (0.16 bug), so
  the fp32 router fails with NameError; defined as None, which selects the plain-torch matmul.
  This one is needed on GPUs without transformer-engine too, so it is applied there as well.
- the CUDA RNG state tracker (`tensor_parallel.random`): megatron forks per-parallel-rank RNG states
  for dropout and weight init; on CPU a tracker with the same interface forks the CPU generator.
- scalars created with a hard-coded `device="cuda"` by the optimizer (`optimizer.optimizer`,
  `optimizer.clip_grads`: loss scale, grad-norm buffers) and the pipeline schedules
  (`pipeline_parallel.schedules`: the token counter) and the plain-torch multi-tensor L2 norm
  (`megatron.core.utils`): those modules see a `torch` whose
  `tensor`/`zeros` put such tensors on the CPU; and gradient clipping, which asserts CUDA tensor
  types, is replaced by the same scaling (grads times max_norm / (norm + 1e-6) when below 1).
  This covers the fp32 optimizer.
- the distributed optimizer's parameter grouping (`DistributedOptimizer.
  _build_model_and_main_param_groups`) accepts only CUDA tensor types by their type strings;
  while it runs, CPU tensors report the CUDA type of their dtype, so the fp32 distributed
  optimizer (shards, main-parameter views, its checkpoint state) runs on the CPU. The bf16
  optimizers are not adapted and stay CUDA-only.

On CUDA without apex or transformer-engine, `enable_cuda_fusions()` gives megatron what those
would (the CPU never uses it: its results stay those of megatron's own code paths):

- gradient-accumulation fusion: megatron's linear layers add each micro-batch's weight gradient
  into the fp32 `main_grad` buffer through apex's `fused_weight_gradient_mlp_cuda`; without it a
  bf16 weight gradient is written, read and added in a separate kernel (a tenth of a 3B training
  step on an H200). The stand-in runs one cuBLAS GEMM with bf16 inputs that accumulates into the
  fp32 buffer (`torch.addmm(..., out_dtype=torch.float32)`), after a probe that the installed
  torch can.
- the gradient norm: megatron's plain-torch `local_multi_tensor_l2_norm` reads each parameter's
  norm back to the host (a wait for the device per parameter); the stand-in computes the same
  2-norm with torch's `get_total_norm` and no host read.

Also required on CPU, but not patchable here: `psutil` must be installed (torch_dist saving
otherwise waits forever for a worker), and scripts that save torch_dist checkpoints need an
`if __name__ == "__main__":` guard (its writer uses multiprocessing spawn).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from rltool.errors import RltoolError

log = logging.getLogger(__name__)

_ENABLED = False
_ENABLE_LOCK = threading.Lock()
_CUDA_NAMES = threading.local()  # .on: CPU tensors report CUDA type names
_FUSED_WGRAD: bool | None = None  # enable_cuda_fusions' probe, once per process


class MegatronUnavailableError(RltoolError):
    """megatron-core is not installed (exit 3: the environment lacks a dependency)."""


def require_megatron() -> None:
    """Raise a one-line error naming the fix when megatron-core cannot be imported."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise MegatronUnavailableError(
            f"megatron-core is required for this command but cannot be imported ({e}); "
            "install it with `pip install 'rltool[megatron]'` (megatron-core>=0.16,<0.17)") from e


def _make_cpu_tracker_class() -> type:
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's RNG tracker over the CPU generator: same names, seeds and fork semantics."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise ValueError(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def enable_cpu() -> bool:
    """Apply the patches (idempotent). Returns True on CPU, False when CUDA is present (then only
    the missing-transformer-engine fix is applied)."""
    import torch

    require_megatron()
    _patch_missing_te_gemm()
    if torch.cuda.is_available():
        return False
    with _ENABLE_LOCK:  # ranks run as threads in one process may call this at once
        if not _ENABLED:
            _enable_cpu()
    return True


def _enable_cpu() -> None:
    global _ENABLED
    import torch

    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    tracker_class = _make_cpu_tracker_class()
    original_init = mrandom.initialize_rng_tracker

    def initialize_rng_tracker(*args: Any, **kwargs: Any) -> None:
        original_init(*args, **kwargs)
        if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, tracker_class):
            mrandom._CUDA_RNG_STATE_TRACKER = tracker_class()

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    _patch_causal_mask()
    _patch_cuda_scalars()
    _patch_distributed_optimizer_types()
    mrandom.initialize_rng_tracker(force_reset=True)
    _ENABLED = True
    log.debug("megatron-core CPU compatibility enabled")


def enable_cuda_fusions() -> bool:
    """Install the CUDA stand-ins for apex's fused kernels (idempotent; CUDA only). Returns whether
    gradient-accumulation fusion can be switched on (`gradient_accumulation_fusion=True`)."""
    global _FUSED_WGRAD
    with _ENABLE_LOCK:
        if _FUSED_WGRAD is None:
            from megatron.core.optimizer import clip_grads
            from megatron.core.tensor_parallel import layers

            if clip_grads.l2_norm_impl.__module__ == "megatron.core.utils":
                clip_grads.l2_norm_impl = _l2_norm
            _FUSED_WGRAD = _wgrad_accumulates()
            if _FUSED_WGRAD and not layers._grad_accum_fusion_available:
                layers.fused_weight_gradient_mlp_cuda = _FusedWgrad
                layers._grad_accum_fusion_available = True
    return _FUSED_WGRAD


class _FusedWgrad:
    """apex's `fused_weight_gradient_mlp_cuda` interface: main_grad += grad_output^T @ input."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: Any, grad_output: Any, main_grad: Any) -> None:
        import torch

        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32,
                    out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: Any, grad_output: Any, main_grad: Any) -> None:
        main_grad.addmm_(grad_output.t(), total_input)


def _wgrad_accumulates() -> bool:
    """Whether this torch runs the fp32-accumulating bf16 GEMM on the GPU, with the right sum."""
    import torch

    if not torch.cuda.is_available():
        return False
    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy = (torch.randn(64, n, device="cuda", generator=g).bfloat16() for n in (32, 48))
    acc = torch.randn(48, 32, device="cuda", generator=g)
    want = acc + dy.t().float() @ x.float()
    try:
        _FusedWgrad.wgrad_gemm_accum_fp32(x, dy, acc)
    except (RuntimeError, TypeError) as e:
        log.info("gradient-accumulation fusion unavailable (%s)", e)
        return False
    return bool(torch.allclose(acc, want, rtol=1e-4, atol=1e-4))


def _l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[Any]],
             per_tensor: bool, *args: Any) -> tuple[Any, None]:
    """`local_multi_tensor_l2_norm` without reading each norm back to the host: the 2-norm of
    the tensors of `tensor_lists` as a float32 tensor [1] on their device."""
    import torch
    from torch.nn.utils import get_total_norm

    tensors = [t for group in tensor_lists for t in group]
    return get_total_norm(tensors).to(torch.float32).reshape(1), None


def _patch_missing_te_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _CpuTorch:
    """`torch` as the optimizer modules see it on CPU: "cuda" tensors are created on the CPU."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def _cpu(kwargs: dict[str, Any]) -> dict[str, Any]:
        if str(kwargs.get("device", "cpu")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return kwargs

    def tensor(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        return torch.tensor(*args, **self._cpu(kwargs))

    def zeros(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        return torch.zeros(*args, **self._cpu(kwargs))


def _patch_cuda_scalars() -> None:
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core import utils
    from megatron.core.pipeline_parallel import schedules

    for module in (optimizer, clip_grads, schedules, utils):
        module.torch = _CpuTorch()

    def clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                     use_decoupled_grad: bool = False) -> None:
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff >= 1.0:
            return
        for param in parameters:
            grad = param.decoupled_grad if use_decoupled_grad else param.grad
            if grad is not None:
                grad.detach().mul_(coeff)

    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _patch_distributed_optimizer_types() -> None:
    """While the distributed optimizer groups its parameters (on the calling thread only),
    `tensor.type()` names a CPU tensor by the CUDA type of its dtype ("torch.cuda.FloatTensor").
    The patched `type` is installed once and is inert elsewhere: a flag per thread, not a swap of
    the method per call, which threads building optimizers at once could leave swapped."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if (args or kwargs or self.is_cuda or not getattr(_CUDA_NAMES, "on", False)
                or name.startswith("torch.cuda.")):  # (installed twice: adds nothing)
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_
    build = DistributedOptimizer._build_model_and_main_param_groups.__func__

    def build_on_cpu(cls: type, *args: Any, **kwargs: Any) -> Any:
        before, _CUDA_NAMES.on = getattr(_CUDA_NAMES, "on", False), True
        try:
            return build(cls, *args, **kwargs)
        finally:
            _CUDA_NAMES.on = before

    DistributedOptimizer._build_model_and_main_param_groups = classmethod(build_on_cpu)


def _patch_causal_mask() -> None:
    import functools

    import torch
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


@contextlib.contextmanager
def distributed(*, tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 0) -> Iterator[None]:
    """`init_distributed` for the block; tears down what it created (the process group when it
    started one, megatron's model-parallel state always), so a library call leaves no global state."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    init_distributed(tp=tp, pp=pp, ep=ep, seed=seed)
    try:
        yield
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if started and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(*, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, etp: int | None = None,
                     seed: int = 0) -> None:
    """Start torch.distributed (gloo on CPU, nccl on GPU) from the torchrun environment, or a
    one-process group when not launched by torchrun, then megatron's model-parallel groups
    (tensor, pipeline, expert, context, expert-tensor; `etp` None: the tensor size)."""
    import torch
    import torch.distributed as dist

    require_megatron()
    cpu = enable_cpu()
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        backend = "gloo" if cpu else "nccl"
        if not cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            # One process: its own store on a port the OS assigns while binding (probing for a
            # free port and binding it later races with every other socket on the host).
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(store.port))
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
        else:
            dist.init_process_group(backend)
    world = dist.get_world_size()
    etp = tp if etp is None else etp
    if world % (tp * pp * cp) or (world // pp) % (ep * etp):
        raise RltoolError(f"world size {world} does not fit --tp {tp} x --pp {pp} x --cp {cp} "
                          f"(x --ep {ep} x --etp {etp}); launch with torchrun --nproc-per-node "
                          "a multiple of tp*pp*cp")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)

