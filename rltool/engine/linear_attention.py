"""Gated DeltaNet (GDN), the linear-attention layer of hybrid models (Qwen3.5): its sizes read from
config.json, and its math in torch (the CPU and deterministic path, and the reference the Triton
kernels of rltool.engine.gdn_kernels are tested against).

A GDN layer keeps, per sequence, a recurrent state S [value heads, key dim, value dim] and the
last `kernel - 1` inputs of its causal depthwise convolution (the conv state). Per token t of a
sequence, after the convolution (SiLU) gives q, k, v (q and k L2-normalised, q scaled by
key_dim^-0.5), with decay g_t = -exp(A_log) * softplus(a_t + dt_bias) <= 0 and rate
beta_t = sigmoid(b_t):

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

Prefill computes this chunk by chunk (`chunked_delta`: C tokens at a time through one triangular
solve, exact up to rounding); decode one step for the whole batch (`recurrent_step`). States are
read and updated in float32 whatever dtype they are stored in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rltool.errors import CheckpointError

CHUNK = 64  # prefill: tokens per triangular solve
SSM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_CONFIG_SSM_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "fp32": "fp32", "bf16": "bf16"}


@dataclass(frozen=True)
class LinearSpec:
    """The hybrid's layer pattern and GDN sizes (config.json's linear_* keys)."""
    linear_layers: tuple[int, ...]  # the GDN layers' indices; every other layer is attention
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    rotary_dim: int  # attention layers rotate the first rotary_dim dims of each head
    ssm_dtype: str  # config.json's mamba_ssm_dtype, else fp32

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim

    @property
    def in_rows(self) -> int:
        """Rows of the fused input projection: qkv (conv channels), z, b, a."""
        return self.conv_dim + self.num_v_heads * self.v_dim + 2 * self.num_v_heads

    def state_bytes(self, *, ssm_dtype: torch.dtype, conv_dtype: torch.dtype) -> int:
        """c_R: one sequence's recurrent and conv states over every GDN layer."""
        ssm = self.num_v_heads * self.k_dim * self.v_dim * _size(ssm_dtype)
        conv = (self.conv_kernel - 1) * self.conv_dim * _size(conv_dtype)
        return len(self.linear_layers) * (ssm + conv)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_linear_spec(cfg: dict[str, Any], *, head_dim: int, where: str) -> LinearSpec:
    """The LinearSpec of a qwen3_5 config.json; a one-line CheckpointError for what the engine's
    GDN does not implement."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(layers)]
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown or len(types) != layers:
        raise CheckpointError(f"{where}: layer_types must name full_attention or "
                              f"linear_attention for each of the {layers} layers")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported "
                              "(silu only)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rotary = int(head_dim * factor)
    if rotary % 2 or rotary <= 0:
        raise CheckpointError(f"{where}: partial_rotary_factor {factor} gives an odd or empty "
                              f"rotary dimension ({rotary}) of head_dim {head_dim}")
    k_heads, v_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if v_heads % k_heads:
        raise CheckpointError(f"{where}: linear_num_value_heads {v_heads} is not a multiple of "
                              f"linear_num_key_heads {k_heads}")
    ssm = str(cfg.get("mamba_ssm_dtype") or "float32")
    if ssm not in _CONFIG_SSM_DTYPES:
        raise CheckpointError(f"{where}: mamba_ssm_dtype {ssm!r} is not supported; use float32 "
                              "or bfloat16")
    return LinearSpec(
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        num_k_heads=k_heads, num_v_heads=v_heads, k_dim=int(cfg["linear_key_head_dim"]),
        v_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)), rotary_dim=rotary,
        ssm_dtype=_CONFIG_SSM_DTYPES[ssm])


# ----- the math ------------------------------------------------------------------------------

def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (FLA's convention, eps inside the root)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution with SiLU of a batch of sequences. x [B, T, C]; weight
    [C, kernel]; state [B, C, kernel - 1] (the inputs before x; None: zeros). Returns the output
    [B, T, C] in x's dtype and the new state [B, C, kernel - 1] (the last kernel - 1 inputs)."""
    B, T, C = x.shape
    width = weight.shape[-1] - 1
    xt = x.transpose(1, 2).to(weight.dtype)
    prev = (torch.zeros(B, C, width, dtype=xt.dtype, device=x.device) if state is None
            else state.to(xt.dtype))
    ext = torch.cat([prev, xt], dim=-1)  # [B, C, width + T]
    out = F.conv1d(ext, weight.unsqueeze(1), groups=C)  # [B, C, T]
    return F.silu(out).transpose(1, 2).to(x.dtype), ext[:, :, -width:]


def chunked_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor, *, chunk: int = CHUNK
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, `chunk` tokens at a time. q, k [H, T, Dk]
    (normalised, q scaled), v [H, T, Dv], g, beta [H, T], state [H, Dk, Dv]; all float32.
    Returns o [H, T, Dv] and the final state.

    Within a chunk starting from state S0, with G_i the cumulative log decay up to token i, the
    updates u solve the unit lower-triangular system
        u_i + beta_i sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S0^T k_i)
    and then o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j,
    S_end = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T."""
    T = q.shape[1]
    out = torch.empty(*v.shape, dtype=v.dtype, device=v.device)
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        G = g[:, s:e].cumsum(-1)  # [H, C]
        n = e - s
        # exp(G_i - G_j) for j <= i; the upper triangle is masked before exp (it may overflow)
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
        kk = (kc @ kc.transpose(-1, -2)) * decay  # [H, C, C]
        system = bc.unsqueeze(-1) * kk.tril(-1) + torch.eye(n, dtype=q.dtype, device=q.device)
        rhs = bc.unsqueeze(-1) * (vc - G.exp().unsqueeze(-1) * (kc @ state))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        qk = (qc @ kc.transpose(-1, -2)) * decay
        out[:, s:e] = G.exp().unsqueeze(-1) * (qc @ state) + qk @ u
        tail = (G[:, -1:] - G).exp().unsqueeze(-1)  # [H, C, 1]
        state = G[:, -1].exp()[:, None, None] * state + (kc * tail).transpose(-1, -2) @ u
    return out, state


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H],
    state [B, H, Dk, Dv] (float32). Returns o [B, H, Dv] and the new state."""
    state = state * g.exp()[..., None, None]
    u = beta.unsqueeze(-1) * (v - torch.einsum("bhk,bhkv->bhv", k, state))
    state = state + k.unsqueeze(-1) * u.unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> torch.Tensor:
    """RMS-normalise x over its last dim (float32, cast back, scaled), times SiLU(gate)."""
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype)
