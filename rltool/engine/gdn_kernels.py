"""Triton kernels of the Gated DeltaNet layers (rltool.engine.linear_attention has the math and
the torch reference they are tested against; rltool.engine.hybrid_model calls them on CUDA
outside the deterministic mode).

Each kernel reads the layer's fused input projection as the GEMM wrote it ([T, in_rows]: the conv
channels, z, b, a) and does in registers what the torch path does in separate ops: the gates
(g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), the L2 norm of q and k per head
(q also scaled by key_dim^-0.5) and the key head a value head reads (h // (Hv / Hk), no repeat).
States live in the pool (rltool.engine.state_pool) and are read and written in place by slot
index, in their storage dtype, with float32 math; a slot of a fresh sequence is zeroed first.

- `causal_conv`: the depthwise causal convolution (SiLU) of packed sequences, its first inputs
  taken from each sequence's conv state and the last kernel - 1 written back (decode: one token
  per row, the slot indices read on the device).
- `decode`: one recurrent step per row (program: row, value head, block of value dims).
- `gated_norm`: the output's RMS norm over each head, times SiLU(z), in one kernel.
- the chunked prefill over packed sequences: rltool.engine.gdn_prefill, on the pieces here.

No host synchronization in `causal_conv`, `decode` and `gated_norm`: the decode step is
capturable in a CUDA graph. Tested on CPU under TRITON_INTERPRET=1
(tests/engine/test_gdn_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rltool.engine.linear_attention import LinearSpec

DECODE_BV = 32  # value dims per decode program: B x Hv x Dv/32 programs fill the GPU at B >= 8


@dataclass(frozen=True)
class GdnLayer:
    """One GDN layer's tensors as the kernels take them; `proj` [T, in_rows] is the fused input
    projection's output (rows contiguous in their last dim)."""
    spec: LinearSpec
    proj: torch.Tensor
    conv_weight: torch.Tensor  # [conv_dim, kernel]
    a_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]


# ----- shared pieces ---------------------------------------------------------------------------

@triton.jit
def gates(Proj, rows, ok, stride_p, h, B_OFF, A_OFF, ALog, DtBias):
    """g and beta of value head h at `rows` (0 where not ok)."""
    b = tl.load(Proj + rows * stride_p + B_OFF + h, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(Proj + rows * stride_p + A_OFF + h, mask=ok, other=0.0).to(tl.float32)
    x = a + tl.load(DtBias + h).to(tl.float32)
    # torch's softplus: x itself past its threshold 20
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(ALog + h).to(tl.float32)) * softplus
    return tl.where(ok, g, 0.0), tl.where(ok, tl.sigmoid(b), 0.0)


@triton.jit
def unit_rows(X, rows, ok, stride_x, col, offs_k, DK):
    """The head vectors X[rows, col:col + DK] in float32, L2-normalised ([BT, BK])."""
    mask = ok[:, None] & (offs_k < DK)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + col + offs_k[None, :], mask=mask,
                other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]  # l2_normalize's eps


# ----- causal convolution ----------------------------------------------------------------------

@triton.jit
def _conv(X, stride_x, Wt, Out, stride_o, State, stride_state, Starts, Ends, Slots, C,
          KW: tl.constexpr, SEQ1: tl.constexpr, POOL: tl.constexpr, BT: tl.constexpr,
          BC: tl.constexpr):
    n = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = offs_c < C
    if SEQ1:
        start = n
        end = n + 1
    else:
        start = tl.load(Starts + n)
        end = tl.load(Ends + n)
    state = State + tl.load(Slots + n).to(tl.int64) * stride_state + offs_c * (KW - 1)
    t = start
    while t < end:
        rows = t + tl.arange(0, BT)
        ok = rows < end
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for w in tl.static_range(KW):
            pos = rows - (KW - 1) + w
            wt = tl.load(Wt + offs_c * KW + w, mask=c_ok, other=0.0).to(tl.float32)
            mine = ok & (pos >= start)
            x = tl.load(X + pos[:, None] * stride_x + offs_c[None, :],
                        mask=mine[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            if POOL:  # inputs before the sequence: its conv state (oldest first)
                before = ok & (pos < start)
                x += tl.load(state[None, :] + (KW - 1 + pos - start)[:, None],
                             mask=before[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            acc += x * wt[None, :]
        y = acc * tl.sigmoid(acc)
        tl.store(Out + rows[:, None] * stride_o + offs_c[None, :],
                 y.to(Out.dtype.element_ty), mask=ok[:, None] & c_ok[None, :])
        t += BT
    if POOL:
        # The last KW - 1 inputs, in order: entry i reads the old state's entry n + i > i - 1
        # (n >= 1 tokens), never one this loop already overwrote.
        for i in tl.static_range(KW - 1):
            pos = end - (KW - 1) + i
            if pos >= start:
                x = tl.load(X + pos * stride_x + offs_c, mask=c_ok, other=0.0).to(tl.float32)
            else:
                x = tl.load(state + KW - 1 + pos - start, mask=c_ok, other=0.0).to(tl.float32)
            tl.store(state + i, x.to(State.dtype.element_ty), mask=c_ok)


def causal_conv(layer: GdnLayer, conv_state: torch.Tensor | None, slots: torch.Tensor, *,
                bounds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The SiLU causal convolution of the conv channels of `layer.proj` ([T, conv_dim] in its
    dtype). `bounds` (starts, ends: int32 [N] on the device): the sequences' token ranges; None:
    one token per row (decode, N = T). `conv_state` [slots + 1, conv_dim, kernel - 1]: read at
    `slots` [N] and updated in place; None: every sequence starts from zeros (nothing kept)."""
    proj, spec = layer.proj, layer.spec
    T, C, kw = proj.shape[0], spec.conv_dim, spec.conv_kernel
    out = torch.empty(T, C, dtype=proj.dtype, device=proj.device)
    n = T if bounds is None else bounds[0].numel()
    pool = conv_state is not None
    state = conv_state if pool else out
    starts, ends = bounds if bounds is not None else (slots, slots)
    bc = 128 if bounds is None else 64
    _conv[(n, triton.cdiv(C, bc))](
        proj, proj.stride(0), layer.conv_weight, out, out.stride(0), state,
        state.stride(0) if pool else 0, starts, ends, slots, C, KW=kw, SEQ1=bounds is None,
        POOL=pool, BT=1 if bounds is None else 16, BC=bc)
    return out


# ----- decode ------------------------------------------------------------------------------------

@triton.jit
def _decode(X, stride_x, Proj, stride_p, ALog, DtBias, State, stride_state, Slots, Out,
            REP, K_OFF, V_OFF, B_OFF, A_OFF, scale, H: tl.constexpr, DK: tl.constexpr,
            DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // REP
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    row = tl.full([1], 0, tl.int32) + b
    yes = row >= 0
    q = tl.sum(unit_rows(X, row, yes, stride_x, hk * DK, offs_k, DK), 0) * scale
    k = tl.sum(unit_rows(X, row, yes, stride_x, K_OFF + hk * DK, offs_k, DK), 0)
    v = tl.load(X + b * stride_x + V_OFF + h * DV + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    g, beta = gates(Proj, row, yes, stride_p, h, B_OFF, A_OFF, ALog, DtBias)
    ptr = (State + tl.load(Slots + b).to(tl.int64) * stride_state + h * DK * DV
           + offs_k[:, None] * DV + offs_v[None, :])
    mask = k_ok[:, None] & v_ok[None, :]
    s = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) * tl.exp(tl.sum(g, 0))
    u = tl.sum(beta, 0) * (v - tl.sum(s * k[:, None], 0))
    s += k[:, None] * u[None, :]
    tl.store(ptr, s.to(State.dtype.element_ty), mask=mask)
    o = tl.sum(s * q[:, None], 0)
    tl.store(Out + (b * H + h) * DV + offs_v, o.to(Out.dtype.element_ty), mask=v_ok)


def column_offsets(spec: LinearSpec) -> dict[str, int]:
    """Column offsets of k and v in the conv output, of b and a in the projection."""
    kd, vd = spec.num_k_heads * spec.k_dim, spec.num_v_heads * spec.v_dim
    return {"K_OFF": kd, "V_OFF": 2 * kd, "B_OFF": spec.conv_dim + vd,
            "A_OFF": spec.conv_dim + vd + spec.num_v_heads}


def decode(layer: GdnLayer, conv_state: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor
           ) -> torch.Tensor:
    """One token per row of B sequences whose states are at `slots` [B] (device) of this layer's
    pool tensors (conv_state [slots + 1, conv_dim, kernel - 1], ssm [slots + 1, Hv, Dk, Dv]),
    both updated in place. Returns o [B, Hv, Dv] in the projection's dtype."""
    spec, proj = layer.spec, layer.proj
    x = causal_conv(layer, conv_state, slots)
    B, H, dv = proj.shape[0], spec.num_v_heads, spec.v_dim
    out = torch.empty(B, H, dv, dtype=proj.dtype, device=proj.device)
    bv = min(DECODE_BV, triton.next_power_of_2(dv))
    _decode[(B, H, triton.cdiv(dv, bv))](
        x, x.stride(0), proj, proj.stride(0), layer.a_log, layer.dt_bias, ssm, ssm.stride(0),
        slots, out, H // spec.num_k_heads, scale=spec.k_dim ** -0.5, H=H, DK=spec.k_dim, DV=dv,
        BK=tile_size(spec.k_dim), BV=bv, **column_offsets(spec))
    return out


def tile_size(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot's smallest tile side


# ----- gated RMS norm -----------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])  # one variant whatever the token count
def _gated_norm(O, Proj, stride_p, Wt, Y, T, eps, Z_OFF, H: tl.constexpr, DV: tl.constexpr,
                BR: tl.constexpr, BV: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    offs = tl.arange(0, BV)
    mask = (rows < T)[:, None] & (offs < DV)[None, :]
    at = (rows[:, None] * H + h) * DV + offs[None, :]
    o = tl.load(O + at, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Proj + rows[:, None] * stride_p + Z_OFF + h * DV + offs[None, :], mask=mask,
                other=0.0).to(tl.float32)
    w = tl.load(Wt + offs, mask=offs < DV, other=0.0)
    # linear_attention.gated_rms_norm's roundings: the normed value and its product with the
    # weight in the model dtype, the SiLU gate in float32
    normed = (o * tl.rsqrt(tl.sum(o * o, 1) / DV + eps)[:, None]).to(w.dtype)
    scaled = (w[None, :].to(tl.float32) * normed.to(tl.float32)).to(w.dtype).to(tl.float32)
    tl.store(Y + at, (scaled * z * tl.sigmoid(z)).to(Y.dtype.element_ty), mask=mask)


def gated_norm(layer: GdnLayer, o: torch.Tensor, weight: torch.Tensor, eps: float
               ) -> torch.Tensor:
    """linear_attention.gated_rms_norm of o [T, Hv, Dv] (the model dtype) gated by the z columns
    of `layer.proj`, in one kernel: [T, Hv * Dv]."""
    spec, proj = layer.spec, layer.proj
    T, H, dv = o.shape
    y = torch.empty(T, H * dv, dtype=o.dtype, device=o.device)
    br = 16
    _gated_norm[(triton.cdiv(T, br), H)](o, proj, proj.stride(0), weight, y, T, eps,
                                         spec.conv_dim, H=H, DV=dv, BR=br,
                                         BV=triton.next_power_of_2(dv))
    return y
