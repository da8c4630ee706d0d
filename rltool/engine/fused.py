"""Fused Triton kernels for the engine's model on CUDA, with the torch versions they replace.

A decode step of a small model is bound by the number of kernels, not by bytes: unfused, one layer
is ~45 kernels (RMSNorm alone is seven). These cut it to ~10 per layer: residual-add + RMSNorm,
RoPE on q and k with the KV-cache write, SiLU-and-multiply. Each rounds where transformers rounds
(every elementwise result back to the model dtype), so bf16 results stay those of the unfused ops.

`*_ref` are the torch versions (used on CPU and as the tests' reference, run by Triton's
interpreter there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rltool.engine.dense_model import apply_rope, rms_norm

try:  # the CPU path never needs triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the dev extra installs triton; CUDA images ship it
    triton = None


# ----- torch references ---------------------------------------------------------------------

def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); with no residual, (rms_norm(x), x)."""
    r = x if residual is None else residual + x
    return rms_norm(r, weight, eps), r


def rope_store_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, *, k_cache: torch.Tensor | None,
                   v_cache: torch.Tensor | None, loc: torch.Tensor | None) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place; write k, v into cache slots `loc`."""
    c, s = cos[positions], sin[positions]
    q.copy_(apply_rope(q, c, s))
    k.copy_(apply_rope(k, c, s))
    if k_cache is not None:
        k_cache.index_copy_(0, loc, k)
        v_cache.index_copy_(0, loc, v)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----- Triton kernels -----------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _add_rms_norm(X, R, W, Out, stride_x, stride_r, stride_o, N, eps,
                      HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RES:
            r = (tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
                 + x.to(tl.float32)).to(x.dtype)
            tl.store(R + row * stride_r + offs, r, mask=mask)
        else:
            r = x
        rf = r.to(tl.float32)
        var = tl.sum(rf * rf, axis=0) / N
        normed = (rf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
        w = tl.load(W + offs, mask=mask, other=0.0)
        tl.store(Out + row * stride_o + offs,
                 (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)

    @triton.jit
    def _rotate(X, Cos, Sin, row, stride_t, stride_h, KC, slot, stride_ct, stride_ch,
                HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_D: tl.constexpr, STORE: tl.constexpr):
        """Rotate-half RoPE on one token's heads in place (and into cache slot `slot`)."""
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < HEADS) & (offs_d[None, :] < HALF)
        base = X + row * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        c = tl.load(Cos + offs_d, mask=offs_d < HALF, other=0.0)[None, :].to(tl.float32)
        s = tl.load(Sin + offs_d, mask=offs_d < HALF, other=0.0)[None, :].to(tl.float32)
        dt = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = ((f1 * c).to(dt).to(tl.float32) + (-f2 * s).to(dt).to(tl.float32)).to(dt)
        o2 = ((f2 * c).to(dt).to(tl.float32) + (f1 * s).to(dt).to(tl.float32)).to(dt)
        tl.store(base, o1, mask=mask)
        tl.store(base + HALF, o2, mask=mask)
        if STORE:
            dst = KC + slot * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
            tl.store(dst, o1, mask=mask)
            tl.store(dst + HALF, o2, mask=mask)

    @triton.jit
    def _rope_store(Q, K, V, Cos, Sin, Pos, KC, VC, Loc,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ct, stride_ch, stride_cos,
                    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    BLOCK_D: tl.constexpr, STORE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(Pos + t).to(tl.int64)
        cos, sin = Cos + pos * stride_cos, Sin + pos * stride_cos
        if STORE:
            slot = tl.load(Loc + t).to(tl.int64)
        else:
            slot = t
        _rotate(Q, cos, sin, t, stride_qt, stride_qh, KC, slot, stride_ct, stride_ch,
                H, HALF, BLOCK_H, BLOCK_HALF, False)
        _rotate(K, cos, sin, t, stride_kt, stride_kh, KC, slot, stride_ct, stride_ch,
                KVH, HALF, BLOCK_KVH, BLOCK_HALF, STORE)
        if STORE:
            offs_h = tl.arange(0, BLOCK_KVH)
            offs_d = tl.arange(0, BLOCK_D)
            mask = (offs_h[:, None] < KVH) & (offs_d[None, :] < D)
            v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                        mask=mask)
            tl.store(VC + slot * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :], v,
                     mask=mask)

    @triton.jit
    def _silu_mul(GU, Out, stride_g, stride_o, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        g = tl.load(GU + row * stride_g + offs, mask=mask, other=0.0)
        u = tl.load(GU + row * stride_g + N + offs, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(Out + row * stride_o + offs,
                 (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused `add_rms_norm_ref`; the residual is updated in place (x is left untouched)."""
    T, N = x.shape
    out = torch.empty_like(x)
    if residual is None:
        _add_rms_norm[(T,)](x, x, weight, out, x.stride(0), x.stride(0), out.stride(0), N, eps,
                            HAS_RES=False, BLOCK=triton.next_power_of_2(N), num_warps=4)
        return out, x
    _add_rms_norm[(T,)](x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0),
                        N, eps, HAS_RES=True, BLOCK=triton.next_power_of_2(N), num_warps=4)
    return out, residual


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, positions: torch.Tensor, *, k_cache: torch.Tensor | None,
               v_cache: torch.Tensor | None, loc: torch.Tensor | None) -> None:
    """Fused `rope_store_ref` (q, k, v may be strided views of the fused qkv output)."""
    T, H, D = q.shape
    kvh = k.shape[1]
    store = k_cache is not None
    kc = k_cache if store else k
    vc = v_cache if store else v
    _rope_store[(T,)](
        q, k, v, cos, sin, positions, kc, vc, loc if store else positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), cos.stride(0),
        H=H, KVH=kvh, D=D, HALF=D // 2, BLOCK_H=triton.next_power_of_2(H),
        BLOCK_KVH=triton.next_power_of_2(kvh), BLOCK_HALF=triton.next_power_of_2(D // 2),
        BLOCK_D=triton.next_power_of_2(D), STORE=store, num_warps=4)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    T, N2 = gate_up.shape
    N = N2 // 2
    out = torch.empty(T, N, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul[(T, triton.cdiv(N, block))](gate_up, out, gate_up.stride(0), out.stride(0), N,
                                         BLOCK=block, num_warps=4)
    return out
