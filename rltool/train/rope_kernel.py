"""Megatron's non-interleaved RoPE of a packed row as one Triton kernel per pass, with autograd.

`rltool.train.megatron_attention.apply_rotary` computes `x * cos + rotate_half(x) * sin` in the
activations' dtype: in bf16 about ten kernels forward and ten backward per layer for q and k
(multiplies, a negation, concatenations, adds), a tenth of a 3B training step's device time on an
H200. This kernel rotates q and k in one launch (each read once, with the row's tables), forward
and backward, with the same roundings as those torch operations, so its bits are theirs:

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
def _rotate(X, Y, offs_t, T, h, stride_xt, stride_xh, stride_yt, stride_yh, Cos, Sin, stride_c,
            HALF: tl.constexpr, REST: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_R: tl.constexpr, BACKWARD: tl.constexpr):
    """Rows `offs_t` of head h of X [T, H, d] rotated into Y."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_t < T)[:, None] & (offs_d < HALF)[None, :]
    x_row = X + offs_t[:, None] * stride_xt + h * stride_xh
    y_row = Y + offs_t[:, None] * stride_yt + h * stride_yh
    t_row = offs_t[:, None] * stride_c
    x1 = tl.load(x_row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(Cos + t_row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + t_row + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    sa = tl.load(Sin + t_row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    sb = tl.load(Sin + t_row + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation: the other half's sine, negated
        s1 = -sb
        s2 = -sa
    else:
        s1 = sa
        s2 = sb
    y1 = _r(_r(x1 * c1) - _r(x2 * s1)).to(tl.bfloat16)  # exact: already a bfloat16 value
    y2 = _r(_r(x2 * c2) + _r(x1 * s2)).to(tl.bfloat16)
    tl.store(y_row + offs_d[None, :], y1, mask=mask)
    tl.store(y_row + HALF + offs_d[None, :], y2, mask=mask)
    if REST > 0:
        offs_r = tl.arange(0, BLOCK_R)
        rmask = (offs_t < T)[:, None] & (offs_r < REST)[None, :]
        rest = tl.load(x_row + 2 * HALF + offs_r[None, :], mask=rmask, other=0.0)
        tl.store(y_row + 2 * HALF + offs_r[None, :], rest, mask=rmask)


# T changes with every packed row: not specialized on (see rltool.engine.fused)
@triton.jit(do_not_specialize=["T"])
def _rope(Q, K, QY, KY, Cos, Sin, T, HQ, sq_t, sq_h, sk_t, sk_h, sqy_t, sqy_h, sky_t, sky_h,
          stride_c, HALF: tl.constexpr, REST: tl.constexpr, BLOCK_T: tl.constexpr,
          BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BACKWARD: tl.constexpr):
    """One program per (block of rows, head of q or of k): q's heads first."""
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = tl.program_id(1)
    if h < HQ:
        _rotate(Q, QY, offs_t, T, h, sq_t, sq_h, sqy_t, sqy_h, Cos, Sin, stride_c, HALF, REST,
                BLOCK_D, BLOCK_R, BACKWARD)
    else:
        _rotate(K, KY, offs_t, T, h - HQ, sk_t, sk_h, sky_t, sky_h, Cos, Sin, stride_c, HALF,
                REST, BLOCK_D, BLOCK_R, BACKWARD)


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
            backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, d], k [T, Hk, d] (any strides with a unit last one); cos/sin [T, rot]
    contiguous -> the rotated q and k, contiguous."""
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    T, hq, d = q.shape
    qy, ky = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k))
    rot = cos.shape[-1]
    half, rest = rot // 2, d - rot
    _rope[(triton.cdiv(T, BLOCK_T), hq + k.shape[1])](
        q, k, qy, ky, cos, sin, T, hq, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        qy.stride(0), qy.stride(1), ky.stride(0), ky.stride(1), cos.stride(0),
        HALF=half, REST=rest, BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(half),
        BLOCK_R=triton.next_power_of_2(max(rest, 1)), BACKWARD=backward, num_warps=4)
    return qy, ky


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        return _launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        # (an output without a gradient arrives as zeros: autograd materializes them)
        cos, sin = ctx.saved_tensors
        return (*_launch(grad_q, grad_k, cos, sin, backward=True), None, None)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, d] and k [T, kv heads, d] (bfloat16) by a packed row's tables cos/sin
    [T, 1, 1, rot] (bfloat16, rot even and <= d), in one launch; differentiable in q and k."""
    assert q.dtype == k.dtype == cos.dtype == sin.dtype == torch.bfloat16
    return _Rotary.apply(q, k, cos.reshape(cos.shape[0], -1).contiguous(),
                         sin.reshape(sin.shape[0], -1).contiguous())
