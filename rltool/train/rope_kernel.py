"""Megatron's non-interleaved RoPE of a packed row as one Triton kernel per pass, with autograd.

`rltool.train.megatron_attention.apply_rotary` computes `x * cos + rotate_half(x) * sin` in the
activations' dtype: in bf16 about ten kernels forward and ten backward per layer for q and k
(multiplies, a negation, concatenations, adds), a tenth of a 3B training step's device time on an
H200. This kernel reads x and the row's tables once and writes the rotated x, forward and
backward, with the same roundings as those torch operations, so its bits are theirs:

    forward   y1 = r(r(x1 c1) - r(x2 s1))         backward  g1 = r(r(G1 c1) + r(G2 s2))
              y2 = r(r(x2 c2) + r(x1 s2))                   g2 = r(r(G2 c2) - r(G1 s1))

where x1/x2 are the first/second half of the rotated channels, c/s the matching halves of the
tables and r() rounds to bfloat16 (each product of two bf16 values is exact in float32, so
rounding it once is what torch's bf16 multiply does). Channels past the tables' width pass
through. bfloat16 activations only: a float32 product is not exact, and the compiler may fuse a
product and a sum into one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16


@triton.jit
def _r(v):
    """float32 v rounded to bfloat16 precision, to nearest even, still as float32: by its bits,
    so Triton's interpreter (whose float casts truncate) rounds as the GPU does."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rope(X, Cos, Sin, Y, T, H, stride_xt, stride_xh, stride_yt, stride_yh, stride_c,
          HALF: tl.constexpr, REST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
          BLOCK_R: tl.constexpr, BACKWARD: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_t < T)[:, None] & (offs_d < HALF)[None, :]
    x_row = X + offs_t[:, None] * stride_xt + h * stride_xh
    y_row = Y + offs_t[:, None] * stride_yt + h * stride_yh
    t_row = offs_t[:, None] * stride_c
    x1 = tl.load(x_row + offs_d[None, :], mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF + offs_d[None, :], mask=mask, other=0.0)
    c1 = tl.load(Cos + t_row + offs_d[None, :], mask=mask, other=0.0)
    c2 = tl.load(Cos + t_row + HALF + offs_d[None, :], mask=mask, other=0.0)
    sa = tl.load(Sin + t_row + offs_d[None, :], mask=mask, other=0.0)
    sb = tl.load(Sin + t_row + HALF + offs_d[None, :], mask=mask, other=0.0)
    x1, x2, c1, c2 = (x1.to(tl.float32), x2.to(tl.float32), c1.to(tl.float32),
                      c2.to(tl.float32))
    if BACKWARD:  # the transpose of the rotation: the other half's sine, negated
        s1 = -sb.to(tl.float32)
        s2 = -sa.to(tl.float32)
    else:
        s1 = sa.to(tl.float32)
        s2 = sb.to(tl.float32)
    y1 = _r(_r(x1 * c1) - _r(x2 * s1)).to(tl.bfloat16)  # exact: already a bfloat16 value
    y2 = _r(_r(x2 * c2) + _r(x1 * s2)).to(tl.bfloat16)
    tl.store(y_row + offs_d[None, :], y1, mask=mask)
    tl.store(y_row + HALF + offs_d[None, :], y2, mask=mask)
    if REST > 0:
        offs_r = tl.arange(0, BLOCK_R)
        rmask = (offs_t < T)[:, None] & (offs_r < REST)[None, :]
        rest = tl.load(x_row + 2 * HALF + offs_r[None, :], mask=rmask, other=0.0)
        tl.store(y_row + 2 * HALF + offs_r[None, :], rest, mask=rmask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
            backward: bool) -> torch.Tensor:
    """x [T, H, d] (any strides with a unit last one); cos/sin [T, rot] contiguous."""
    T, H, d = x.shape
    rot = cos.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((T, H, d), dtype=x.dtype, device=x.device)
    half, rest = rot // 2, d - rot
    _rope[(triton.cdiv(T, BLOCK_T), H)](
        x, cos, sin, y, T, H, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0),
        HALF=half, REST=rest, BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(half),
        BLOCK_R=triton.next_power_of_2(max(rest, 1)), BACKWARD=backward, num_warps=4)
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _launch(grad, cos, sin, backward=True), None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, d] (bfloat16) by a packed row's tables cos/sin [T, 1, 1, rot]
    (bfloat16, rot even and <= d); differentiable in x."""
    assert x.dtype == cos.dtype == sin.dtype == torch.bfloat16
    return _Rotary.apply(x, cos.reshape(cos.shape[0], -1).contiguous(),
                         sin.reshape(sin.shape[0], -1).contiguous())
