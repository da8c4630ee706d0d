"""Fused Triton kernels for the engine's model on CUDA, with the torch versions they replace.

A decode step of a small model is bound by the number of kernels, not by bytes: unfused, one layer
is ~45 kernels (RMSNorm alone is seven). These cut it to ~10 per layer: residual-add + RMSNorm,
RoPE on q and k with the KV-cache write, SiLU-and-multiply. Each rounds where transformers rounds
(every elementwise result back to the model dtype), so bf16 results stay those of the unfused ops.
Before a linear kept in FP8, the norm and SiLU-and-multiply (`block_k` given) write their result
only quantized for the block-FP8 GEMM (rltool.engine.fp8_gemm.Fp8Activations): the bytes and
scales the separate quantization kernel would write from the rounded result, one kernel fewer.

`*_ref` are the torch versions (used on CPU and as the tests' reference, run by Triton's
interpreter there).

One compiled variant per kernel and shape class: Triton compiles a new variant of a kernel for
each combination of its integer arguments' divisibility by 16 (and equality to 1) and its pointer
arguments' 16-byte alignment. Token counts change with every batch, and the per-token index rows
(positions, sequence lengths) are rows of one packed int64 tensor, so an odd count misaligns
them. The engine's kernels therefore do not specialize on those arguments (`do_not_specialize`,
`do_not_specialize_on_alignment`; each is a bound or a one-element load per program, where the
hint buys nothing): without it, a warmed-up engine still stalled ~1 s compiling whenever a batch
first met a new combination (an H200, the FP8 7B engine's first 256-prompt batch: 1.4 s to first
token against 0.43-0.51 s for the next ones; 0.54 s with it; `python -m benchmarks.engine_gpu
--mode first-batches`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rltool.engine.dense_model import apply_rope, rms_norm
from rltool.engine.paged import quantize_kv

try:  # the CPU path never needs triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the dev extra installs triton; CUDA images ship it
    triton = None


# ----- torch references ---------------------------------------------------------------------

def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, block_k: int | None = None
                     ) -> tuple[torch.Tensor | Fp8Activations, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); with no residual, (rms_norm(x), x). With
    `block_k`, the first quantized for the block-FP8 GEMM by its own kernel."""
    r = x if residual is None else residual + x
    return quantized(rms_norm(r, weight, eps), block_k), r


def rope_store_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, *, k_cache: torch.Tensor | None,
                   v_cache: torch.Tensor | None, loc: torch.Tensor | None,
                   k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place; write k, v into cache slots `loc`
    (quantized, with their scales written to `k_scale`/`v_scale`, for an FP8 cache)."""
    c, s = cos[positions], sin[positions]
    q.copy_(apply_rope(q, c, s))
    k.copy_(apply_rope(k, c, s))
    if k_cache is not None:
        store_kv(k, v, k_cache, v_cache, loc, k_scale, v_scale)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             loc: torch.Tensor, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None) -> None:
    """Write k, v into cache slots `loc` (quantized, their scales into `k_scale`/`v_scale`,
    for an FP8 cache)."""
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if scales is None:
            cache.index_copy_(0, loc, x)
        else:
            qx, sx = quantize_kv(x)  # bytes: CPU index_copy_ has no float8 kernel
            cache.view(torch.uint8).index_copy_(0, loc, qx.view(torch.uint8))
            scales.index_copy_(0, loc, sx)


def silu_mul_ref(gate_up: torch.Tensor, block_k: int | None = None
                 ) -> torch.Tensor | Fp8Activations:
    gate, up = gate_up.chunk(2, dim=-1)
    return quantized(F.silu(gate) * up, block_k)


def quantized(x: torch.Tensor, block_k: int | None) -> torch.Tensor | Fp8Activations:
    """x, or with `block_k` its quantization for the block-FP8 GEMM (fp8_gemm.activations)."""
    if block_k is None:
        return x
    from rltool.engine.fp8_gemm import activations

    return activations(x, block_k)


# ----- Triton kernels -----------------------------------------------------------------------

if triton is not None:
    from rltool.batch_invariant import INTERPRETED
    from rltool.engine.fp8_gemm import Fp8Activations, empty_activations
    from rltool.engine.fp8_kernels import E4M3_MAX, SCALE_FLOOR, store_quantized, to_e4m3

    @triton.jit(do_not_specialize=["T", "ROWS"])
    def _add_rms_norm(X, R, W, Out, Q, S, stride_x, stride_r, stride_o, T, ROWS, N, eps,
                      HAS_RES: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
        """One row: Out (or, with QUANT, its FP8 quantization into Q, S; rows T..ROWS zeros)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = (offs < N) & (row < T)
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
        out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
        if QUANT:
            store_quantized(out.to(tl.float32), Q + row * N, S + row, ROWS, N, BLOCK, BLOCK_K,
                            EMULATE)
        else:
            tl.store(Out + row * stride_o + offs, out, mask=mask)

    @triton.jit
    def _store_kv(KC, KS, slot, stride_ct, stride_ch, stride_st, offs_h, offs_d, mask, x1, x2,
                  HALF: tl.constexpr, FP8: tl.constexpr, EMULATE: tl.constexpr):
        """Write one token's heads (their two halves) into cache slot `slot`: as they are, or
        quantized per head (scale = max(max|x|, 1e-12) / 448) with the scales into KS."""
        dst = KC + slot * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
        if FP8:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(f1), axis=1), tl.max(tl.abs(f2), axis=1))
            scale = tl.maximum(amax, SCALE_FLOOR) / E4M3_MAX  # masked elements are 0
            tl.store(dst, to_e4m3(tl.clamp(f1 / scale[:, None], -E4M3_MAX, E4M3_MAX), EMULATE),
                     mask=mask)
            tl.store(dst + HALF, to_e4m3(tl.clamp(f2 / scale[:, None], -E4M3_MAX, E4M3_MAX),
                                         EMULATE), mask=mask)
            tl.store(KS + slot * stride_st + offs_h, scale,
                     mask=tl.max(mask.to(tl.int32), axis=1) > 0)
        else:
            tl.store(dst, x1, mask=mask)
            tl.store(dst + HALF, x2, mask=mask)

    @triton.jit
    def _rotate(X, Cos, Sin, row, stride_t, stride_h, KC, KS, slot, stride_ct, stride_ch,
                stride_st, HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_D: tl.constexpr, STORE: tl.constexpr, FP8: tl.constexpr,
                EMULATE: tl.constexpr):
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
            _store_kv(KC, KS, slot, stride_ct, stride_ch, stride_st, offs_h, offs_d, mask, o1, o2,
                      HALF, FP8, EMULATE)

    @triton.jit(do_not_specialize_on_alignment=["Pos", "KS", "VS", "Loc"])
    def _rope_store(Q, K, V, Cos, Sin, Pos, KC, VC, KS, VS, Loc,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ct, stride_ch, stride_st, stride_cos,
                    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    STORE: tl.constexpr, FP8: tl.constexpr, EMULATE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(Pos + t).to(tl.int64)
        cos, sin = Cos + pos * stride_cos, Sin + pos * stride_cos
        if STORE:
            slot = tl.load(Loc + t).to(tl.int64)
        else:
            slot = t
        _rotate(Q, cos, sin, t, stride_qt, stride_qh, KC, KS, slot, stride_ct, stride_ch,
                stride_st, H, HALF, BLOCK_H, BLOCK_HALF, False, FP8, EMULATE)
        _rotate(K, cos, sin, t, stride_kt, stride_kh, KC, KS, slot, stride_ct, stride_ch,
                stride_st, KVH, HALF, BLOCK_KVH, BLOCK_HALF, STORE, FP8, EMULATE)
        if STORE:  # v in its two halves, so that it is stored like k
            offs_h = tl.arange(0, BLOCK_KVH)
            offs_d = tl.arange(0, BLOCK_HALF)
            mask = (offs_h[:, None] < KVH) & (offs_d[None, :] < HALF)
            src = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            _store_kv(VC, VS, slot, stride_ct, stride_ch, stride_st, offs_h, offs_d, mask,
                      tl.load(src, mask=mask, other=0.0), tl.load(src + HALF, mask=mask, other=0.0),
                      HALF, FP8, EMULATE)

    @triton.jit(do_not_specialize=["T", "ROWS"])
    def _silu_mul(GU, Out, Q, S, stride_g, stride_o, T, ROWS, N, QUANT: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
        """One row's BLOCK columns: Out (or, with QUANT, their FP8 quantization into Q, S; rows
        T..ROWS zeros)."""
        row = tl.program_id(0).to(tl.int64)
        start = tl.program_id(1) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        mask = (offs < N) & (row < T)
        g = tl.load(GU + row * stride_g + offs, mask=mask, other=0.0)
        u = tl.load(GU + row * stride_g + N + offs, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        out = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
        if QUANT:
            store_quantized(out.to(tl.float32), Q + row * N + start,
                            S + (start // BLOCK_K) * ROWS + row, ROWS, N - start, BLOCK, BLOCK_K,
                            EMULATE)
        else:
            tl.store(Out + row * stride_o + offs, out, mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, block_k: int | None = None
                 ) -> tuple[torch.Tensor | Fp8Activations, torch.Tensor]:
    """Fused `add_rms_norm_ref`; the residual is updated in place (x is left untouched). With
    `block_k`, the normalized rows are written only quantized, in one kernel."""
    T, N = x.shape
    res = x if residual is None else residual
    out, q, s, rows = _outputs(x, T, N, block_k)
    block = max(triton.next_power_of_2(N), block_k or 1)
    _add_rms_norm[(rows,)](x, res, weight, q if block_k else out, q, s, x.stride(0),
                           res.stride(0), 0 if block_k else out.stride(0), T, rows, N, eps,
                           HAS_RES=residual is not None, QUANT=block_k is not None, BLOCK=block,
                           BLOCK_K=block_k or block, EMULATE=INTERPRETED, num_warps=4)
    return out, res


def _outputs(x: torch.Tensor, T: int, N: int, block_k: int | None):
    """(the result: a tensor like x [T, N] or its Fp8Activations, the e4m3 and scale tensors to
    write (x when unquantized), the rows to launch)."""
    if block_k is None:
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
        return out, x, x, T
    act = empty_activations(T, N, block_k, x.dtype, x.device)
    return act, act.q, act.s, act.q.shape[0]


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, positions: torch.Tensor, *, k_cache: torch.Tensor | None,
               v_cache: torch.Tensor | None, loc: torch.Tensor | None,
               k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> None:
    """Fused `rope_store_ref` (q, k, v may be strided views of the fused qkv output)."""
    T, H, D = q.shape
    kvh = k.shape[1]
    store = k_cache is not None
    fp8 = k_scale is not None
    kc = k_cache if store else k
    vc = v_cache if store else v
    ks, vs = (k_scale, v_scale) if fp8 else (positions, positions)
    _rope_store[(T,)](
        q, k, v, cos, sin, positions, kc, vc, ks, vs, loc if store else positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), ks.stride(0), cos.stride(0),
        H=H, KVH=kvh, D=D, HALF=D // 2, BLOCK_H=triton.next_power_of_2(H),
        BLOCK_KVH=triton.next_power_of_2(kvh), BLOCK_HALF=triton.next_power_of_2(D // 2),
        STORE=store, FP8=fp8, EMULATE=INTERPRETED, num_warps=4)


def silu_mul(gate_up: torch.Tensor, block_k: int | None = None
             ) -> torch.Tensor | Fp8Activations:
    """Fused `silu_mul_ref`; with `block_k`, the result is written only quantized."""
    T, N2 = gate_up.shape
    N = N2 // 2
    out, q, s, rows = _outputs(gate_up, T, N, block_k)
    block = max(1024, block_k or 0)
    _silu_mul[(rows, triton.cdiv(N, block))](
        gate_up, q if block_k else out, q, s, gate_up.stride(0), 0 if block_k else out.stride(0),
        T, rows, N, QUANT=block_k is not None, BLOCK=block, BLOCK_K=block_k or block,
        EMULATE=INTERPRETED, num_warps=4)
    return out
