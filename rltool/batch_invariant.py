"""Batch-invariant kernels: the result for one row never depends on the other rows of its batch.

A library GEMM picks its tiling and split-K from the problem shape, and a reduction kernel splits
a row across blocks when there are few rows; both change the order in which a row's sums are
added, so the same sequence gives other bits alone than among 15 others. The Triton kernels
here fix that order: matmuls with constant block sizes and no split-K (each output element sums
over K in BLOCK_K steps, whatever M and N are), and row-wise mean and log-softmax with a constant
block per row.

`enabled(device_type)` routes aten's `mm`, `addmm`, `mean.dim` and `_log_softmax` on that
device to them (torch.library), for the code inside the block: the engine's deterministic mode
runs its forwards inside it and the torch trainer in deterministic mode on CUDA does too, so
both sides compute every product, norm and log-softmax the same way (the align gate's exact
zero). Anything else (attention, elementwise ops) must be invariant by construction: the engine
runs attention per request with a fixed KV split. On CPU the kernels run under Triton's
interpreter (TRITON_INTERPRET=1), which is how the tests check invariance without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

from rltool.errors import BadInputError

try:  # CPU installs without triton never enable these kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the dev extra installs triton; CUDA images ship it
    triton = None

# Constants on purpose: a row's reduction order depends on BLOCK_K and BLOCK_ROW only.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
BLOCK_ROW = 1024
# Under Triton's interpreter tl.dot is numpy's matmul, whose result for a row depends on the row's
# position inside the block; there the product is an explicit sum over k (in order) instead, and
# a row program handles 16 rows (the interpreter's cost is per program).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROWS = 16 if INTERPRETED else 1

if triton is not None:
    @triton.jit
    def _mm_step(A, B, acc, k0, offs_m, offs_n, offs_k, M, N, K, stride_am, stride_ak,
                 stride_bk, stride_bn, PRECISION: tl.constexpr, EXPLICIT: tl.constexpr):
        ks = k0 + offs_k
        a = tl.load(A + offs_m[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(B + ks[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(ks[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        if EXPLICIT:
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _matmul(A, B, C, Bias, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                stride_cm, stride_cn, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                EXPLICIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if EXPLICIT:  # the interpreter cannot range() over an argument
            k0 = 0
            while k0 < K:
                acc = _mm_step(A, B, acc, k0, offs_m, offs_n, offs_k, M, N, K, stride_am,
                               stride_ak, stride_bk, stride_bn, PRECISION, EXPLICIT)
                k0 += BLOCK_K
        else:  # a for loop: software-pipelined on the GPU
            for k0 in range(0, K, BLOCK_K):
                acc = _mm_step(A, B, acc, k0, offs_m, offs_n, offs_k, M, N, K, stride_am,
                               stride_ak, stride_bk, stride_bn, PRECISION, EXPLICIT)
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                 acc.to(C.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.jit
    def _row_mean(X, Out, R, N, stride_x, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        base = X + rows[:, None] * stride_x
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        start = 0
        while start < N:  # Triton's interpreter cannot range() over arguments
            offs = start + tl.arange(0, BLOCK)
            mask = (rows[:, None] < R) & (offs[None, :] < N)
            acc += tl.load(base + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            start += BLOCK
        tl.store(Out + rows, (tl.sum(acc, axis=1) / N).to(Out.dtype.element_ty), mask=rows < R)

    @triton.jit
    def _row_log_softmax(X, Out, R, N, stride_x, stride_o, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        base = X + rows[:, None] * stride_x
        m = tl.full([ROWS, BLOCK], float("-inf"), dtype=tl.float32)
        start = 0
        while start < N:  # Triton's interpreter cannot range() over arguments
            offs = start + tl.arange(0, BLOCK)
            mask = (rows[:, None] < R) & (offs[None, :] < N)
            x = tl.load(base + offs[None, :], mask=mask, other=float("-inf"))
            m = tl.maximum(m, x.to(tl.float32))
            start += BLOCK
        big = tl.max(m, axis=1)
        big = tl.where(big == float("-inf"), 0.0, big)  # rows past R
        s = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        start = 0
        while start < N:
            offs = start + tl.arange(0, BLOCK)
            mask = (rows[:, None] < R) & (offs[None, :] < N)
            x = tl.load(base + offs[None, :], mask=mask, other=float("-inf"))
            s += tl.exp(x.to(tl.float32) - big[:, None])
            start += BLOCK
        lse = big + tl.log(tl.sum(s, axis=1))
        start = 0
        while start < N:
            offs = start + tl.arange(0, BLOCK)
            mask = (rows[:, None] < R) & (offs[None, :] < N)
            x = tl.load(base + offs[None, :], mask=mask, other=0.0)
            tl.store(Out + rows[:, None] * stride_o + offs[None, :],
                     (x.to(tl.float32) - lse[:, None]).to(Out.dtype.element_ty), mask=mask)
            start += BLOCK


def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) with a tiling that does not depend on M or N."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise BadInputError(f"mm: shapes {list(a.shape)} and {list(b.shape)} do not multiply")
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if bias is not None:
        bias = bias.expand(N).contiguous()
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _matmul[grid](a, b, out, bias if bias is not None else out, M, N, K, a.stride(0), a.stride(1),
                  b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                  HAS_BIAS=bias is not None, PRECISION=precision, EXPLICIT=INTERPRETED,
                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3)
    return out


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
           alpha: float = 1) -> torch.Tensor:
    if beta == 1 and alpha == 1 and bias.dim() <= 1:
        return mm(a, b, bias)
    return beta * bias + alpha * mm(a, b)


def _rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, list[int]]:
    """x with `dim` moved last, as a contiguous [rows, n] matrix, and the moved shape."""
    moved = x.movedim(dim, -1).contiguous()
    return moved.view(-1, moved.shape[-1]), list(moved.shape)


def _mean(x: torch.Tensor, dim: list[int] | None, keepdim: bool = False, *,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    dims = list(range(x.dim())) if not dim else [d % x.dim() for d in dim]
    if len(dims) != 1 or not x.is_floating_point():
        count = 1
        for d in dims:
            count *= x.shape[d]
        return torch.sum(x, dims, keepdim, dtype=dtype) / count
    x2, shape = _rows(x if dtype is None else x.to(dtype), dims[0])
    R = x2.shape[0]
    out = torch.empty(R, dtype=x2.dtype, device=x.device)
    if R:
        _row_mean[(triton.cdiv(R, ROWS),)](x2, out, R, x2.shape[1], x2.stride(0), ROWS=ROWS,
                                          BLOCK=BLOCK_ROW)
    out = out.view(shape[:-1])
    return out.unsqueeze(dims[0]) if keepdim else out


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    x2, shape = _rows(x, dim % x.dim())
    dtype = torch.float32 if half_to_float else x.dtype
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    R = x2.shape[0]
    if R:
        _row_log_softmax[(triton.cdiv(R, ROWS),)](x2, out, R, x2.shape[1], x2.stride(0),
                                                  out.stride(0), ROWS=ROWS, BLOCK=BLOCK_ROW)
    return out.view(shape).movedim(-1, dim % x.dim())


_lock = threading.Lock()
_active: dict[str, tuple[int, torch.library.Library]] = {}


@contextlib.contextmanager
def enabled(device_type: str) -> Iterator[None]:
    """Route aten's mm, addmm, mean.dim and _log_softmax on `device_type` ("cuda" or "cpu") to
    the kernels above while the block runs (nestable, process-wide: torch.library)."""
    if triton is None:
        raise BadInputError("batch-invariant kernels need triton; install rltool's dev extra or "
                            "a CUDA build of torch that ships it")
    key = {"cuda": "CUDA", "cpu": "CPU"}[device_type]
    with _lock:
        depth, lib = _active.get(key, (0, None))
        if lib is None:
            lib = torch.library.Library("aten", "IMPL")
            lib.impl("aten::mm", lambda a, b: mm(a, b), key)
            lib.impl("aten::addmm", _addmm, key)
            lib.impl("aten::mean.dim", _mean, key)
            lib.impl("aten::_log_softmax", _log_softmax, key)
        _active[key] = (depth + 1, lib)
    try:
        yield
    finally:
        with _lock:
            depth, lib = _active[key]
            if depth == 1:
                del _active[key]
                lib._destroy()
            else:
                _active[key] = (depth - 1, lib)
