"""Random inputs of one Gated DeltaNet layer and the torch reference of its recurrence
(rltool.engine.linear_attention's functions, as HybridLM._gdn_torch calls them), for the tests of
the Triton kernels (rltool.engine.gdn_kernels, gdn_prefill)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rltool.engine.gdn_kernels import GdnLayer
from rltool.engine.linear_attention import (LinearSpec, causal_conv, chunked_delta, l2_normalize,
                                            recurrent_step)


def spec_of(*, k_heads: int, v_heads: int, k_dim: int, v_dim: int) -> LinearSpec:
    return LinearSpec(linear_layers=(0,), num_k_heads=k_heads, num_v_heads=v_heads, k_dim=k_dim,
                      v_dim=v_dim, conv_kernel=4, rotary_dim=8, ssm_dtype="fp32")


def random_layer(spec: LinearSpec, num_tokens: int, *, gen: torch.Generator,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> GdnLayer:
    """A layer's projection output and parameters at the scales of a trained model (decays
    mostly close to 1, some fast)."""
    h = spec.num_v_heads
    rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s).to(dtype).to(device)
    return GdnLayer(spec=spec, proj=rand(num_tokens, spec.in_rows),
                    conv_weight=rand(spec.conv_dim, spec.conv_kernel, s=0.5),
                    a_log=rand(h, s=0.5), dt_bias=rand(h, s=0.5))


def random_states(spec: LinearSpec, num_slots: int, *, gen: torch.Generator,
                  conv_dtype: torch.dtype = torch.float32, ssm_dtype: torch.dtype = torch.float32,
                  device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's pool tensors (slot 0 the scratch slot), every slot nonzero."""
    conv = torch.randn(num_slots + 1, spec.conv_dim, spec.conv_kernel - 1, generator=gen)
    ssm = torch.randn(num_slots + 1, spec.num_v_heads, spec.k_dim, spec.v_dim, generator=gen)
    return conv.to(conv_dtype).to(device), (0.3 * ssm).to(ssm_dtype).to(device)


def _qkv(spec: LinearSpec, x: torch.Tensor):
    n, kd = x.shape[0], spec.num_k_heads * spec.k_dim
    rep = spec.num_v_heads // spec.num_k_heads
    q, k, v = x.float().split([kd, kd, spec.num_v_heads * spec.v_dim], dim=-1)
    q, k = (l2_normalize(t.reshape(n, spec.num_k_heads, spec.k_dim)).repeat_interleave(rep, 1)
            for t in (q, k))
    return q * spec.k_dim ** -0.5, k, v.reshape(n, spec.num_v_heads, spec.v_dim)


def _gates(layer: GdnLayer):
    spec, h = layer.spec, layer.spec.num_v_heads
    _, _, b, a = layer.proj.split([spec.conv_dim, h * spec.v_dim, h, h], dim=-1)
    g = -layer.a_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    return g, b.float().sigmoid()


def reference_prefill(layer: GdnLayer, conv: torch.Tensor | None, ssm: torch.Tensor | None,
                      segments: list[tuple[int, int, int, bool]]) -> torch.Tensor:
    """o [T, Hv, Dv] float32; conv and ssm (the pool's tensors, or None) updated in place."""
    spec, T = layer.spec, layer.proj.shape[0]
    mixed = layer.proj[:, :spec.conv_dim].float()
    g, beta = _gates(layer)
    dev = layer.proj.device
    out = torch.empty(T, spec.num_v_heads, spec.v_dim, device=dev)
    for off, n, slot, fresh in segments:
        stored = ssm is not None and not fresh
        x, c = causal_conv(mixed[off:off + n].unsqueeze(0), layer.conv_weight.float(),
                           conv[slot:slot + 1].float() if stored else None)
        q, k, v = (t.transpose(0, 1) for t in _qkv(spec, x[0]))
        state = (ssm[slot].float() if stored else
                 torch.zeros(spec.num_v_heads, spec.k_dim, spec.v_dim, device=dev))
        o, state = chunked_delta(q, k, v, g[off:off + n].T, beta[off:off + n].T, state)
        out[off:off + n] = o.transpose(0, 1)
        if ssm is not None:
            conv[slot] = c[0].to(conv.dtype)
            ssm[slot] = state.to(ssm.dtype)
    return out


def reference_decode(layer: GdnLayer, conv: torch.Tensor, ssm: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    """o [B, Hv, Dv] float32 of one step; conv and ssm updated at `slots` in place."""
    spec = layer.spec
    g, beta = _gates(layer)
    x, c = causal_conv(layer.proj[:, :spec.conv_dim].float().unsqueeze(1),
                       layer.conv_weight.float(), conv[slots].float())
    conv[slots] = c.to(conv.dtype)
    q, k, v = _qkv(spec, x[:, 0])
    o, state = recurrent_step(q, k, v, g, beta, ssm[slots].float())
    ssm[slots] = state.to(ssm.dtype)
    return o
