"""The chunked prefill of the Gated DeltaNet layers over packed variable-length sequences, in Triton
(rltool.engine.gdn_kernels has the layer's other kernels and the pieces these share; the torch
reference is linear_attention.chunked_delta).

The sequences are a `PrefillPlan`, built once per forward for every GDN layer; CHUNK tokens per
chunk, in three kernels (the WY form of the chunk, as in the Gated DeltaNet paper and FLA):
`_chunk_prep`, parallel over (chunk, head), builds T = (I + A)^-1 for the chunk's
A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i; `_unit_lower_inverse`) and from it
W = T (beta exp(G) k) and U = T (beta v), so that the chunk's updates are U - W S0;
`_chunk_state`, sequential over a sequence's chunks (program: sequence, head, value block),
carries S across chunks and keeps each chunk's starting state and updates; `_chunk_out`,
parallel again, gives o = exp(G) q S0 + (q k^T * decay, causal) (U - W S0). Each sequence starts
from its slot's states (a fresh one's slot zeroed first) and leaves its final ones there.

Float32 models multiply in IEEE float32, bf16 ones in TF32 (its rounding is below bf16's);
accumulation is float32 either way. Tested on CPU under TRITON_INTERPRET=1
(tests/engine/test_gdn_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rltool.engine.gdn_kernels import (GdnLayer, causal_conv, column_offsets, gates, tile_size,
                                       unit_rows)
from rltool.engine.linear_attention import CHUNK

STATE_BV = 32  # value dims per program of the sequential chunk pass (its only parallelism)
SUB = tl.constexpr(16)  # rows per diagonal block of the chunk's triangular inverse (CHUNK / 4)


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)
    return tl.dot(a, b, input_precision="tf32", out_dtype=tl.float32)


@triton.jit
def _unit_lower_inverse(A, idx, IEEE: tl.constexpr, BT: tl.constexpr):
    """(I + A)^-1 for A [BT, BT] strictly lower triangular, in blocks of SUB rows: D, the inverse
    of the block diagonal, by forward substitution in all blocks at once (row i of each block is
    e_i - sum_{j<i} A_ij D_j: SUB - 1 steps, not BT - 1); then, with N = D A_o (A_o: A below the
    diagonal blocks, so N is nilpotent of degree BT / SUB), (I + A)^-1 = (I + N)^-1 D =
    (I - N + N^2 - N^3) D. Rows past a chunk's end have A rows of 0 and come out as e_i."""
    tl.static_assert(BT == 4 * SUB)  # the series below ends at N^3
    eye = tl.where(idx[:, None] == idx[None, :], 1.0, 0.0)
    same = (idx // SUB)[:, None] == (idx // SUB)[None, :]
    diag = tl.where(same, A, 0.0)
    D = eye
    for i in range(1, SUB):
        sel = (idx % SUB) == i
        D = tl.where(sel[:, None], eye - _mm(tl.where(sel[:, None], diag, 0.0), D, IEEE), D)
    N = _mm(D, tl.where(same, 0.0, A), IEEE)
    N2 = _mm(N, N, IEEE)
    series = eye - N + N2 - _mm(N2, N, IEEE)
    return _mm(series, D, IEEE)


@triton.jit
def _chunk_prep(X, stride_x, Proj, stride_p, ALog, DtBias, ChunkStart, ChunkEnd, Wbuf, Ubuf,
                Gbuf, REP, K_OFF, V_OFF, B_OFF, A_OFF, H: tl.constexpr, DK: tl.constexpr,
                DV: tl.constexpr, IEEE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(ChunkStart + c)
    end = tl.load(ChunkEnd + c)
    rows = start + tl.arange(0, BT)
    ok = rows < end
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    idx = tl.arange(0, BT)
    col_k = K_OFF + (h // REP) * DK
    k = unit_rows(X, rows, ok, stride_x, col_k, offs_k, DK)
    g, beta = gates(Proj, rows, ok, stride_p, h, B_OFF, A_OFF, ALog, DtBias)
    G = tl.cumsum(g, 0)
    lower = idx[:, None] > idx[None, :]
    decay = tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))
    A = _mm(k, tl.trans(k), IEEE) * decay * beta[:, None]
    T = _unit_lower_inverse(A, idx, IEEE, BT)
    # k again from memory rather than held through the inverse (registers: ptxas spilled)
    k = unit_rows(X, rows, ok, stride_x, col_k, offs_k, DK)
    w = _mm(T, k * (beta * tl.exp(G))[:, None], IEEE)
    tl.store(Wbuf + (rows[:, None] * H + h) * DK + offs_k[None, :], w,
             mask=ok[:, None] & (offs_k < DK)[None, :])
    v_mask = ok[:, None] & (offs_v < DV)[None, :]
    v = tl.load(X + rows[:, None] * stride_x + V_OFF + h * DV + offs_v[None, :], mask=v_mask,
                other=0.0).to(tl.float32)
    u = _mm(T, v * beta[:, None], IEEE)
    tl.store(Ubuf + (rows[:, None] * H + h) * DV + offs_v[None, :], u, mask=v_mask)
    tl.store(Gbuf + rows * H + h, G, mask=ok)


@triton.jit
def _chunk_state(X, stride_x, State, stride_state, Starts, Ends, Chunk0, Slots, Wbuf, Ubuf,
                 Gbuf, Hbuf, REP, K_OFF, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 POOL: tl.constexpr, IEEE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    kv_mask = k_ok[:, None] & v_ok[None, :]
    kv_offs = offs_k[:, None] * DV + offs_v[None, :]
    state = State + tl.load(Slots + n).to(tl.int64) * stride_state + h * DK * DV + kv_offs
    if POOL:
        s = tl.load(state, mask=kv_mask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    t = tl.load(Starts + n)
    end = tl.load(Ends + n)
    c = tl.load(Chunk0 + n).to(tl.int64)
    while t < end:
        rows = t + tl.arange(0, BT)
        ok = rows < end
        last = tl.minimum(t + BT, end) - 1
        tl.store(Hbuf + (c * H + h) * DK * DV + kv_offs, s, mask=kv_mask)
        k = unit_rows(X, rows, ok, stride_x, K_OFF + (h // REP) * DK, offs_k, DK)
        w = tl.load(Wbuf + (rows[:, None] * H + h) * DK + offs_k[None, :],
                    mask=ok[:, None] & k_ok[None, :], other=0.0)
        u_ptr = Ubuf + (rows[:, None] * H + h) * DV + offs_v[None, :]
        u_mask = ok[:, None] & v_ok[None, :]
        u = tl.load(u_ptr, mask=u_mask, other=0.0) - _mm(w, s, IEEE)
        tl.store(u_ptr, u, mask=u_mask)  # the chunk's updates, for _chunk_out
        G = tl.load(Gbuf + rows * H + h, mask=ok, other=0.0)
        g_last = tl.load(Gbuf + last * H + h)
        tail = tl.where(ok, tl.exp(g_last - G), 0.0)
        s = tl.exp(g_last) * s + _mm(tl.trans(k * tail[:, None]), u, IEEE)
        t += BT
        c += 1
    if POOL:
        tl.store(state, s.to(State.dtype.element_ty), mask=kv_mask)


@triton.jit
def _chunk_out(X, stride_x, ChunkStart, ChunkEnd, Ubuf, Gbuf, Hbuf, Out, REP, K_OFF, scale,
               H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, IEEE: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // REP
    rows = tl.load(ChunkStart + c) + tl.arange(0, BT)
    ok = rows < tl.load(ChunkEnd + c)
    idx = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    v_ok = offs_v < DV
    q = unit_rows(X, rows, ok, stride_x, hk * DK, offs_k, DK) * scale
    k = unit_rows(X, rows, ok, stride_x, K_OFF + hk * DK, offs_k, DK)
    G = tl.load(Gbuf + rows * H + h, mask=ok, other=0.0)
    s = tl.load(Hbuf + (c.to(tl.int64) * H + h) * DK * DV + offs_k[:, None] * DV
                + offs_v[None, :], mask=(offs_k < DK)[:, None] & v_ok[None, :], other=0.0)
    u = tl.load(Ubuf + (rows[:, None] * H + h) * DV + offs_v[None, :],
                mask=ok[:, None] & v_ok[None, :], other=0.0)
    causal = (idx[:, None] >= idx[None, :]) & ok[:, None]  # rows past the end: G 0, no exp
    qk = _mm(q, tl.trans(k), IEEE) * tl.exp(tl.where(causal, G[:, None] - G[None, :],
                                                     float("-inf")))
    o = tl.exp(G)[:, None] * _mm(q, s, IEEE) + _mm(qk, u, IEEE)
    tl.store(Out + (rows[:, None] * H + h) * DV + offs_v[None, :], o.to(Out.dtype.element_ty),
             mask=ok[:, None] & v_ok[None, :])


@dataclass(frozen=True)
class PrefillPlan:
    """The device index tensors of a packed prefill, shared by its GDN layers: per sequence its
    start, end, first chunk and state slot (int64); per chunk its start and end (CHUNK tokens,
    the last of a sequence shorter); the slots of the fresh sequences (int64)."""
    starts: torch.Tensor
    ends: torch.Tensor
    chunk0: torch.Tensor
    chunk_start: torch.Tensor
    chunk_end: torch.Tensor
    slots: torch.Tensor
    fresh: torch.Tensor

    @staticmethod
    def of(segments: list[tuple[int, int, int, bool]], device: torch.device) -> "PrefillPlan":
        """The plan of packed sequences [(offset, length, slot, fresh)]: one host-to-device
        copy."""
        starts = [o for o, *_ in segments]
        ends = [o + n for o, n, *_ in segments]
        chunk0, c_start, c_end = [], [], []
        for o, n, *_ in segments:
            chunk0.append(len(c_start))
            c_start.extend(range(o, o + n, CHUNK))
            c_end.extend(min(s + CHUNK, o + n) for s in range(o, o + n, CHUNK))
        slots = [s for *_, s, _ in segments]
        fresh = [s for *_, s, f in segments if f]
        flat = torch.tensor(starts + ends + chunk0 + c_start + c_end + slots + fresh,
                            dtype=torch.int64).to(device, non_blocking=True)
        n, m = len(segments), len(c_start)
        parts = flat.split([n, n, n, m, m, n, len(fresh)])
        return PrefillPlan(*(t.to(torch.int32) for t in parts[:5]), *parts[5:])


def prefill(layer: GdnLayer, conv_state: torch.Tensor | None, ssm: torch.Tensor | None,
            plan: PrefillPlan) -> torch.Tensor:
    """The GDN layer's recurrence over the packed sequences of `plan` in `layer.proj`. With the
    pool's tensors of this layer (conv_state, ssm: see `decode`) each sequence starts from its
    slot's states (zeros if fresh) and leaves its final ones there; without (None, None) every
    sequence starts from zeros and its states are dropped. Returns o [T, Hv, Dv] in the
    projection's dtype."""
    spec, proj = layer.spec, layer.proj
    dev, pool = proj.device, ssm is not None
    c_start, c_end = plan.chunk_start, plan.chunk_end
    if pool and plan.fresh.numel():
        conv_state[plan.fresh] = 0
        ssm[plan.fresh] = 0
    x = causal_conv(layer, conv_state, plan.slots, bounds=(plan.starts, plan.ends))
    T, H, dk, dv = proj.shape[0], spec.num_v_heads, spec.k_dim, spec.v_dim
    f32 = dict(dtype=torch.float32, device=dev)
    w, u, G = torch.empty(T, H, dk, **f32), torch.empty(T, H, dv, **f32), torch.empty(T, H, **f32)
    hbuf = torch.empty(c_start.numel(), H, dk, dv, **f32)
    out = torch.empty(T, H, dv, dtype=proj.dtype, device=dev)
    off = column_offsets(spec)
    rep, ieee = H // spec.num_k_heads, proj.dtype == torch.float32
    bk, bv = tile_size(dk), tile_size(dv)
    sizes = dict(H=H, DK=dk, DV=dv, IEEE=ieee, BT=CHUNK, BK=bk)
    _chunk_prep[(c_start.numel(), H)](x, x.stride(0), proj, proj.stride(0), layer.a_log,
                                      layer.dt_bias, c_start, c_end, w, u, G, rep, **off,
                                      BV=bv, num_warps=8, **sizes)
    sbv = min(STATE_BV, bv)
    state = ssm if pool else hbuf
    _chunk_state[(plan.starts.numel(), H, triton.cdiv(dv, sbv))](
        x, x.stride(0), state, state.stride(0) if pool else 0, plan.starts, plan.ends,
        plan.chunk0, plan.slots, w, u, G, hbuf, rep, off["K_OFF"], POOL=pool, BV=sbv,
        num_warps=8, **sizes)
    obv = min(64, bv)
    _chunk_out[(c_start.numel(), H, triton.cdiv(dv, obv))](
        x, x.stride(0), c_start, c_end, u, G, hbuf, out, rep, off["K_OFF"], dk ** -0.5, BV=obv,
        num_warps=8, **sizes)
    return out
