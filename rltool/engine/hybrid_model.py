"""The engine's model of Qwen3.5's dense-MLP hybrid (HF qwen3_5_text, Qwen3_5ForCausalLM): Gated
DeltaNet layers (rltool.engine.linear_attention) interleaved with gated full-attention layers.

It differs from the dense families (rltool.engine.dense_model, whose weight checks, loading and
logits it shares) in: the GDN layers; attention whose q_proj also yields a sigmoid output gate
per head, with RoPE on the first `rotary_dim` dims of each head only; and zero-centred RMS norms
(scaled by 1 + weight). The GDN recurrence runs through Triton kernels on CUDA
(rltool.engine.gdn_kernels, gdn_prefill), in torch ops on the CPU and in the deterministic
mode.

Fused layouts: an attention layer's `qkv` stacks q_proj (query and gate interleaved per head, as
HF stores them), k_proj and v_proj; a GDN layer's `gdn_in` stacks in_proj_qkv, in_proj_z,
in_proj_b and in_proj_a (one GEMM; the deterministic full pass splits it again as transformers
does, `_gdn_as_trainer`). The forward gets the attention callback of the dense model (called
with the model's layer index; only attention layers have KV) and a `Recurrence` that says where
each sequence's GDN states live (rltool.engine.state_pool).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from rltool.batch_invariant import INTERPRETED
from rltool.engine import gdn_kernels, gdn_prefill
from rltool.engine.dense_model import Attend, DenseLM, apply_rope
from rltool.engine.fused import store_kv
from rltool.engine.linear_attention import (SSM_DTYPES, causal_conv, chunked_delta,
                                            gated_rms_norm, l2_normalize, recurrent_step)
from rltool.engine.model_checkpoint import load_checkpoint, read_index
from rltool.engine.model_spec import ModelSpec, read_spec
from rltool.engine.quant import linear
from rltool.engine.rope import rope_frequencies
from rltool.engine.state_pool import Recurrence
from rltool.errors import BadInputError


def zero_centred_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm scaled by (1 + weight), all in float32, cast back at the end (HF's order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


class HybridLM(DenseLM):
    """Parameters as plain tensors (HF naming, fused where noted) and a packed forward."""

    def __init__(self, spec: ModelSpec, *, device: torch.device | str, dtype: torch.dtype):
        assert spec.linear is not None
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype
        # As for DenseLM, fused vs transformers' op sequence (DenseLM's Triton paths behind
        # `fused` are in methods overridden here). True: the GDN layers' stacked input GEMM and
        # the engine's chunk solve in every pass, through the Triton kernels where
        # `gdn_kernels` (CUDA; the CPU under TRITON_INTERPRET=1); False (the runner's
        # deterministic mode): the pass beside the pool runs them as transformers does
        # (_gdn_as_trainer), the pool's passes in linear_attention's torch ops.
        self.fused = True
        self.gdn_kernels = self.device.type == "cuda" or INTERPRETED
        self.fp8_keys: frozenset[tuple[int, str]] = frozenset()
        s, ls = spec, spec.linear
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        empty = lambda *shape: torch.empty(*shape, device=self.device, dtype=dtype)
        self._alloc_outer(empty)
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(s.num_layers):
            layer = {"ln1": empty(s.hidden_size), "ln2": empty(s.hidden_size),
                     "gate_up": empty(2 * s.intermediate_size, s.hidden_size),
                     "down": empty(s.hidden_size, s.intermediate_size)}
            if i in ls.linear_layers:
                v = ls.num_v_heads * ls.v_dim
                layer.update({"gdn_in": empty(ls.in_rows, s.hidden_size),
                              "conv": empty(ls.conv_dim, 1, ls.conv_kernel),
                              "A_log": empty(ls.num_v_heads), "dt_bias": empty(ls.num_v_heads),
                              "gdn_norm": empty(ls.v_dim), "out": empty(s.hidden_size, v)})
            else:
                layer.update({"qkv": empty(2 * q + 2 * kv, s.hidden_size),
                              "o": empty(s.hidden_size, q), "q_norm": empty(s.head_dim),
                              "k_norm": empty(s.head_dim)})
                if s.qkv_bias:
                    layer["qkv_bias"] = empty(2 * q + 2 * kv)
            self.layers.append(layer)
        self._gdn_index = {layer: j for j, layer in enumerate(ls.linear_layers)}
        rot = ls.rotary_dim
        self._inv_freq, self._rope_scale = rope_frequencies(s.rope, dim=rot, theta=s.rope_theta)
        self._rope_cache = None

    # ----- weights -------------------------------------------------------------------------

    def _targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        s, ls = self.spec, self.spec.linear
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        v = ls.num_v_heads * ls.v_dim
        out = self._outer_targets()
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            out.update({
                p + "input_layernorm.weight": (L["ln1"], 0, s.hidden_size),
                p + "post_attention_layernorm.weight": (L["ln2"], 0, s.hidden_size)})
            out.update(self._mlp_targets(p, L))
            if "gdn_in" in L:
                a = p + "linear_attn."
                rows = [("in_proj_qkv", ls.conv_dim), ("in_proj_z", v),
                        ("in_proj_b", ls.num_v_heads), ("in_proj_a", ls.num_v_heads)]
                start = 0
                for name, n in rows:
                    out[a + name + ".weight"] = (L["gdn_in"], start, n)
                    start += n
                out.update({a + "conv1d.weight": (L["conv"], 0, ls.conv_dim),
                            a + "A_log": (L["A_log"], 0, ls.num_v_heads),
                            a + "dt_bias": (L["dt_bias"], 0, ls.num_v_heads),
                            a + "norm.weight": (L["gdn_norm"], 0, ls.v_dim),
                            a + "out_proj.weight": (L["out"], 0, s.hidden_size)})
                continue
            a = p + "self_attn."
            out.update({a + "q_proj.weight": (L["qkv"], 0, 2 * q),
                        a + "k_proj.weight": (L["qkv"], 2 * q, kv),
                        a + "v_proj.weight": (L["qkv"], 2 * q + kv, kv),
                        a + "o_proj.weight": (L["o"], 0, s.hidden_size),
                        a + "q_norm.weight": (L["q_norm"], 0, s.head_dim),
                        a + "k_norm.weight": (L["k_norm"], 0, s.head_dim)})
            if s.qkv_bias:
                out.update({a + "q_proj.bias": (L["qkv_bias"], 0, 2 * q),
                            a + "k_proj.bias": (L["qkv_bias"], 2 * q, kv),
                            a + "v_proj.bias": (L["qkv_bias"], 2 * q + kv, kv)})
        return out

    # ----- forward -------------------------------------------------------------------------

    def rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, *, k_cache: torch.Tensor | None = None,
                   v_cache: torch.Tensor | None = None, loc: torch.Tensor | None = None,
                   k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
        """Rotate the first rotary_dim dims of q and k in place by their positions; write k, v
        into cache slots `loc` (quantized, their scales into `k_scale`/`v_scale`, for FP8)."""
        cos, sin = self.rope_table(self.spec.max_position_embeddings)
        c, s = cos[positions], sin[positions]
        rot = self.spec.linear.rotary_dim
        q[..., :rot] = apply_rope(q[..., :rot], c, s)
        k[..., :rot] = apply_rope(k[..., :rot], c, s)
        if k_cache is not None:
            store_kv(k, v, k_cache, v_cache, loc, k_scale, v_scale)

    def hidden(self, input_ids: torch.Tensor, attend: Attend,
               collect: list[torch.Tensor] | None = None,
               routed: list[torch.Tensor] | None = None, *,
               recurrence: Recurrence | None = None) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of a packed token stream (see DenseLM.hidden);
        `recurrence`: the GDN layers' sequences and states (default: one fresh sequence)."""
        s = self.spec
        rec = recurrence if recurrence is not None else Recurrence.alone(len(input_ids))
        plan = (gdn_prefill.PrefillPlan.of(rec.segments, self.device)
                if self.fused and self.gdn_kernels and rec.segments is not None else None)
        x = F.embedding(input_ids, self.embed)
        if collect is not None:
            collect.append(x)
        for i, L in enumerate(self.layers):
            h = zero_centred_norm(x, L["ln1"], s.rms_norm_eps)
            if "gdn_in" in L and rec.pool is None and not self.fused:
                x = x + self._gdn_as_trainer(L, h)
            elif "gdn_in" in L:
                x = x + self._gdn(self._gdn_index[i], L, h, rec, plan)
            else:
                x = x + self._attention(i, L, h, attend)
            h = zero_centred_norm(x, L["ln2"], s.rms_norm_eps)
            gate, up = linear(h, L["gate_up"]).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, L["down"])
            if collect is not None and i + 1 < len(self.layers):
                collect.append(x)
        out = zero_centred_norm(x, self.norm, s.rms_norm_eps)
        if collect is not None:
            collect.append(out)
        return out

    def _attention(self, i: int, L: dict[str, torch.Tensor], h: torch.Tensor,
                   attend: Attend) -> torch.Tensor:
        s = self.spec
        T, q_size = h.shape[0], s.num_heads * s.head_dim
        kv_size = s.num_kv_heads * s.head_dim
        qg, k, v = linear(h, L["qkv"], L.get("qkv_bias")).split([2 * q_size, kv_size, kv_size],
                                                                  dim=-1)
        q, gate = qg.reshape(T, s.num_heads, 2 * s.head_dim).chunk(2, dim=-1)
        q = zero_centred_norm(q, L["q_norm"], s.rms_norm_eps)
        k = zero_centred_norm(k.reshape(T, s.num_kv_heads, s.head_dim), L["k_norm"],
                              s.rms_norm_eps)
        a = attend(i, q, k, v.reshape(T, s.num_kv_heads, s.head_dim)).reshape(T, q_size)
        return linear(a * torch.sigmoid(gate.reshape(T, q_size)), L["o"])

    def _gdn(self, j: int, L: dict[str, torch.Tensor], h: torch.Tensor, rec: Recurrence,
             plan: gdn_prefill.PrefillPlan | None) -> torch.Tensor:
        """Gated DeltaNet layer `j` (among the GDN layers) over the packed stream; `plan`: the
        kernels' index tensors of a prefill."""
        ls, T = self.spec.linear, h.shape[0]
        hv, dv = ls.num_v_heads, ls.v_dim
        proj = linear(h, L["gdn_in"])
        eps = self.spec.rms_norm_eps
        if self.fused and self.gdn_kernels:
            layer = gdn_kernels.GdnLayer(spec=ls, proj=proj, conv_weight=L["conv"].squeeze(1),
                                         a_log=L["A_log"], dt_bias=L["dt_bias"])
            out = self._gdn_kernels(j, layer, rec, plan)
            return linear(gdn_kernels.gated_norm(layer, out, L["gdn_norm"], eps), L["out"])
        out = self._gdn_torch(j, L, proj, rec)
        z = proj[:, ls.conv_dim:ls.conv_dim + hv * dv]
        y = gated_rms_norm(out.to(h.dtype), z.reshape(T, hv, dv), L["gdn_norm"], eps)
        return linear(y.reshape(T, hv * dv), L["out"])

    def _gdn_torch(self, j: int, L: dict[str, torch.Tensor], proj: torch.Tensor,
                   rec: Recurrence) -> torch.Tensor:
        """The GDN recurrence of layer `j` in torch ops (linear_attention's reference): o [T, Hv,
        Dv] in float32, the pool's states updated."""
        ls, T = self.spec.linear, proj.shape[0]
        hv, dv = ls.num_v_heads, ls.v_dim
        mixed, _, b, a = proj.split([ls.conv_dim, hv * dv, hv, hv], dim=-1)
        beta = b.sigmoid()
        g = -L["A_log"].float().exp() * F.softplus(a.float() + L["dt_bias"])
        weight = L["conv"].squeeze(1)
        pool = rec.pool
        if rec.segments is None:  # decode: one token per row, every row's state in the pool
            slots = rec.slots
            x, conv = causal_conv(mixed.unsqueeze(1), weight, pool.conv[j][slots])
            pool.conv[j][slots] = conv.to(pool.conv.dtype)
            q, k, v = self._qkv(x[:, 0])
            out, state = recurrent_step(q, k, v, g, beta.float(), pool.ssm[j][slots].float())
            pool.ssm[j][slots] = state.to(pool.ssm.dtype)
            return out
        out = torch.empty(T, hv, dv, dtype=torch.float32, device=proj.device)
        for off, n, slot, fresh in rec.segments:
            stored = pool is not None and not fresh
            x, conv = causal_conv(mixed[off:off + n].unsqueeze(0), weight,
                                  pool.conv[j][slot:slot + 1] if stored else None)
            q, k, v = (t.transpose(0, 1) for t in self._qkv(x[0]))
            state = (pool.ssm[j][slot].float() if stored else
                     torch.zeros(hv, ls.k_dim, dv, dtype=torch.float32, device=proj.device))
            o, state = chunked_delta(q, k, v, g[off:off + n].T, beta[off:off + n].T.float(),
                                     state)
            out[off:off + n] = o.transpose(0, 1)
            if pool is not None:
                pool.conv[j][slot] = conv[0].to(pool.conv.dtype)
                pool.ssm[j][slot] = state.to(pool.ssm.dtype)
        return out

    @staticmethod
    def _gdn_kernels(j: int, layer: gdn_kernels.GdnLayer, rec: Recurrence,
                     plan: gdn_prefill.PrefillPlan | None) -> torch.Tensor:
        """The GDN recurrence of layer `j` through the Triton kernels (rltool.engine.gdn_kernels,
        gdn_prefill): o [T, Hv, Dv] in the model dtype, the pool's states updated in place."""
        pool = rec.pool
        if rec.segments is None:
            return gdn_kernels.decode(layer, pool.conv[j], pool.ssm[j], rec.slots)
        if pool is None:
            return gdn_prefill.prefill(layer, None, None, plan)
        return gdn_prefill.prefill(layer, pool.conv[j], pool.ssm[j], plan)

    def _gdn_as_trainer(self, L: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """A GDN layer over one whole sequence as transformers' Qwen3_5GatedDeltaNet computes it
        without a cache, op for op and in its shapes (a batch of one): the four input projections
        one by one, its causal convolution (`causal_conv1d_fn`, zero padding) and its chunked
        delta rule (`torch_chunk_gated_delta_rule`), both called from transformers, which
        dispatches them as it does for the trainer (pure torch where FLA and causal-conv1d are
        absent). Bit-equal to the trainer's layer in fp32 on the CPU (docs/align.md)."""
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            causal_conv1d_fn, torch_chunk_gated_delta_rule)

        ls, T = self.spec.linear, h.shape[0]
        hv, dv, kd = ls.num_v_heads, ls.v_dim, ls.num_k_heads * ls.k_dim
        x = h.unsqueeze(0)
        w_qkv, w_z, w_b, w_a = L["gdn_in"].split([ls.conv_dim, hv * dv, hv, hv])
        mixed = F.linear(x, w_qkv).transpose(1, 2)
        z = F.linear(x, w_z)
        b, a = F.linear(x, w_b), F.linear(x, w_a)
        mixed = causal_conv1d_fn(mixed, L["conv"].squeeze(1), None, activation="silu")
        q, k, v = mixed.transpose(1, 2).split([kd, kd, hv * dv], dim=-1)
        g = -L["A_log"].float().exp() * F.softplus(a.float() + L["dt_bias"])
        # key heads repeated for their value heads here, as the layer does in transformers
        # releases whose delta rule takes equal head counts (later ones repeat inside it: a no-op
        # on heads already repeated)
        rep = hv // ls.num_k_heads
        q, k = (t.reshape(1, T, -1, ls.k_dim).repeat_interleave(rep, dim=2) for t in (q, k))
        out, _ = torch_chunk_gated_delta_rule(
            q, k, v.reshape(1, T, -1, dv), g=g, beta=b.sigmoid(), initial_state=None,
            output_final_state=False, use_qk_l2norm_in_kernel=True)
        y = gated_rms_norm(out.reshape(-1, dv), z.reshape(-1, dv), L["gdn_norm"],
                           self.spec.rms_norm_eps)
        return F.linear(y.reshape(1, T, -1), L["out"])[0]

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv output [N, conv_dim] -> q, k [N, Hv, Dk] (L2-normalised, q scaled; key heads
        repeated for their value heads) and v [N, Hv, Dv], float32."""
        ls, N = self.spec.linear, x.shape[0]
        kd = ls.num_k_heads * ls.k_dim
        q, k, v = x.float().split([kd, kd, ls.num_v_heads * ls.v_dim], dim=-1)
        rep = ls.num_v_heads // ls.num_k_heads
        q, k = (l2_normalize(t.reshape(N, ls.num_k_heads, ls.k_dim)).repeat_interleave(rep, dim=1)
                for t in (q, k))
        return q * ls.k_dim ** -0.5, k, v.reshape(N, ls.num_v_heads, ls.v_dim)


def check_hybrid_flags(spec: ModelSpec, *, ratio: float | None, ssm_dtype: str | None) -> None:
    """Refuse, in one line naming the fix, what a served model cannot take: bad hybrid flags, or
    any for a model without GDN layers. (A hybrid's prefix cache holds recurrent-state snapshots:
    rltool.engine.hybrid_prefix.)"""
    if ssm_dtype is not None and ssm_dtype not in SSM_DTYPES:
        raise BadInputError(f"unknown --mamba-ssm-dtype {ssm_dtype!r}; choose fp32 or bf16")
    if ratio is not None and not ratio > 0:
        raise BadInputError(f"--mamba-full-memory-ratio {ratio}: must be > 0 (the state pool's "
                            "share over the KV pool's, e.g. 0.9)")
    if spec.linear is None:
        given = [flag for flag, v in (("--mamba-full-memory-ratio", ratio),
                                      ("--mamba-ssm-dtype", ssm_dtype)) if v is not None]
        if given:
            raise BadInputError(f"{' and '.join(given)} apply to hybrid linear-attention models "
                                f"only; {spec.arch} has no recurrent state: drop them")


def load_hybrid(model_dir: str | Path, *, device: torch.device | str, dtype: torch.dtype,
                spec: ModelSpec | None = None) -> HybridLM:
    """Build a HybridLM from a HF checkpoint directory (every tensor checked before any is kept;
    a block-FP8 checkpoint is dequantized into `dtype`)."""
    model_dir = Path(model_dir)
    spec = spec or read_spec(model_dir)
    model = HybridLM(spec, device=device, dtype=dtype)
    load_checkpoint(model, model_dir, index=read_index(model_dir))
    return model
