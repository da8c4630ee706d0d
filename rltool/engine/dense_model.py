"""The engine's own model definition for decoder-only LMs: the dense qwen2, qwen3 and llama families
and the qwen3_moe family (its sparse MLP block in rltool.engine.moe).

Loaded straight from a HF checkpoint (config.json + *.safetensors: rltool.engine.model_spec,
rltool.engine.model_checkpoint). Projections are fused for speed (q/k/v into one matrix, gate/up
into one); `load_tensors` maps HF tensor names onto the fused slices, so weight updates by name
(from disk or from tensors) need no HF model.

The forward pass is packed: one flat [T] stream of tokens from any number of sequences. Attention
is delegated to an `attend(layer, q, k, v)` callback that owns the KV cache and the positions
(rltool.engine.paged_forward), so this module knows nothing about pages or batches; it may hand
back o_proj's input already quantized for an FP8 o_proj. On CUDA the
elementwise work runs in fused Triton kernels (rltool.engine.fused), on CPU as torch ops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rltool.engine import moe, quant
from rltool.engine.model_checkpoint import load_checkpoint, read_index
from rltool.engine.model_spec import ModelSpec, read_spec
from rltool.engine.quant import linear
from rltool.engine.rope import rope_frequencies
from rltool.errors import BadInputError, CheckpointError

# The layers' linear weights: FP8-resident on CUDA when the checkpoint stores them in block FP8.
LINEAR_KEYS = ("qkv", "o", "gate_up", "down", "experts_gate_up", "experts_down")

# attend(layer index, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D], or o_proj's input
# [T, H * D] already quantized for its FP8 weight (rltool.engine.fp8_gemm.Fp8Activations)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], Any]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' order of operations: normalise in fp32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [T, heads, D]; cos/sin [T, D] (each half repeated)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class DenseLM:
    """Parameters as plain tensors (HF naming, fused where noted) and a packed forward."""

    # --enable-lora: the adapter the linears add (rltool.engine.lora); None: no LoRA compute
    lora: Any = None

    def __init__(self, spec: ModelSpec, *, device: torch.device | str, dtype: torch.dtype,
                 fp8_keys: frozenset[tuple[int, str]] = frozenset(), fp8_block_k: int = 128,
                 int4: Any = None):
        """`fp8_keys`: the (layer, linear) weights kept quantized: in FP8 (with K-blocks of
        `fp8_block_k`), or in INT4 when `int4` (the checkpoint's Int4Format) is given."""
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype
        self.fused = self.device.type == "cuda"  # Triton kernels; torch ops on CPU
        self.fp8_keys = fp8_keys
        s = spec
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        empty = lambda *shape: torch.empty(*shape, device=self.device, dtype=dtype)
        self._alloc_outer(empty)
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(s.num_layers):
            layer = {"qkv": empty(q + 2 * kv, s.hidden_size), "o": empty(s.hidden_size, q),
                     "ln1": empty(s.hidden_size), "ln2": empty(s.hidden_size)}
            if self._sparse(i):
                layer.update(moe.allocate(s.moe, s.hidden_size, empty))
            else:
                layer["gate_up"] = empty(2 * s.intermediate_size, s.hidden_size)
                layer["down"] = empty(s.hidden_size, s.intermediate_size)
            if s.qkv_bias:
                layer["qkv_bias"] = empty(q + 2 * kv)
            if s.qk_norm:
                layer["q_norm"], layer["k_norm"] = empty(s.head_dim), empty(s.head_dim)
            for key in LINEAR_KEYS:
                if (i, key) in fp8_keys and int4 is not None:
                    layer[key] = quant.Int4Weight.empty(*layer[key].shape, fmt=int4,
                                                        device=self.device)
                elif (i, key) in fp8_keys:
                    layer[key] = quant.Fp8Weight.empty(*layer[key].shape, block_k=fp8_block_k,
                                                       device=self.device)
            self.layers.append(layer)
        # transformers' RoPE (default, linear or yarn), computed the same way (fp32).
        self._inv_freq, self._rope_scale = rope_frequencies(s.rope, dim=s.head_dim,
                                                            theta=s.rope_theta)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def _alloc_outer(self, empty: Callable[..., torch.Tensor]) -> None:
        """Allocate the tensors outside the layers: embedding, lm_head (the embedding when
        tied), final norm."""
        s = self.spec
        self.embed = empty(s.vocab_size, s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else empty(s.vocab_size, s.hidden_size)
        self.norm = empty(s.hidden_size)

    def _sparse(self, layer: int) -> bool:
        return self.spec.moe is not None and layer in self.spec.moe.sparse_layers

    # ----- weights -------------------------------------------------------------------------

    def _outer_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """The `_targets` outside the layers: embedding, final norm, untied lm_head."""
        s = self.spec
        out: dict[str, tuple[torch.Tensor, int, int]] = {
            "model.embed_tokens.weight": (self.embed, 0, s.vocab_size),
            "model.norm.weight": (self.norm, 0, s.hidden_size)}
        if not s.tie_word_embeddings:
            out["lm_head.weight"] = (self.lm_head, 0, s.vocab_size)
        return out

    def _mlp_targets(self, p: str,
                     L: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int, int]]:
        """The `_targets` of layer prefix `p`'s dense MLP (gate and up fused in L["gate_up"])."""
        s = self.spec
        inter = s.intermediate_size
        return {p + "mlp.gate_proj.weight": (L["gate_up"], 0, inter),
                p + "mlp.up_proj.weight": (L["gate_up"], inter, inter),
                p + "mlp.down_proj.weight": (L["down"], 0, s.hidden_size)}

    def _targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF tensor name -> (destination tensor, row offset, rows) in the fused layout."""
        s = self.spec
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        out = self._outer_targets()
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            out.update({
                p + "self_attn.q_proj.weight": (L["qkv"], 0, q),
                p + "self_attn.k_proj.weight": (L["qkv"], q, kv),
                p + "self_attn.v_proj.weight": (L["qkv"], q + kv, kv),
                p + "self_attn.o_proj.weight": (L["o"], 0, s.hidden_size),
                p + "input_layernorm.weight": (L["ln1"], 0, s.hidden_size),
                p + "post_attention_layernorm.weight": (L["ln2"], 0, s.hidden_size)})
            if self._sparse(i):
                out.update(moe.targets(s.moe, p + "mlp.", L))
            else:
                out.update(self._mlp_targets(p, L))
            if s.qkv_bias:
                out.update({p + "self_attn.q_proj.bias": (L["qkv_bias"], 0, q),
                            p + "self_attn.k_proj.bias": (L["qkv_bias"], q, kv),
                            p + "self_attn.v_proj.bias": (L["qkv_bias"], q + kv, kv)})
            if s.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (L["q_norm"], 0, s.head_dim)
                out[p + "self_attn.k_norm.weight"] = (L["k_norm"], 0, s.head_dim)
        return out

    def check_tensors(self, shapes: dict[str, tuple[int, ...]], *, where: str) -> None:
        """Refuse a set of HF tensors that is not exactly this model's (names and shapes)."""
        targets = self._targets()
        for name, shape in shapes.items():
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue  # some tied checkpoints store the head as well
            if name not in targets:
                raise CheckpointError(f"{where}: tensor {name!r} is not a parameter of the "
                                      "served model")
            dest, _, rows = targets[name]
            want = (rows, *dest.shape[1:])
            if tuple(shape) != want:
                raise CheckpointError(f"{where}: tensor {name!r} has shape {list(shape)}, the "
                                      f"served model expects {list(want)}")
        missing = [n for n in targets if n not in shapes]
        if missing:
            raise CheckpointError(f"{where} lacks {len(missing)} tensors of the served model, "
                                  f"e.g. {missing[0]!r}")

    def fp8_sources(self) -> dict[tuple[int, str], list[str]]:
        """(layer, linear key) -> the HF weight names fused into it."""
        owner = {id(t): (i, key) for i, L in enumerate(self.layers) for key, t in L.items()
                 if key in LINEAR_KEYS}
        out: dict[tuple[int, str], list[str]] = {}
        for name, (dest, _, _) in self._targets().items():
            base = dest if dest._base is None else dest._base
            if id(base) in owner:
                out.setdefault(owner[id(base)], []).append(name)
        return out

    def checked_tensors(self, named: list[tuple[str, torch.Tensor | quant.BlockFp8]], *,
                        update_dtype: torch.dtype
                        ) -> list[tuple[str, torch.Tensor | quant.BlockFp8]]:
        """The tensors of an in-memory update that `load_tensors` takes, after checking every
        name, shape and dtype (BadInputError on the first mismatch, before anything is copied);
        a tied head is dropped (it is the embedding). FP8 and INT4 weights take `update_dtype`
        (the model's dtype) and are quantized on load; INT4 tensors as stored (`weight_packed`
        with its companions) are taken as one weight."""
        targets = self._targets()
        named = quant.pair_int4(named)
        keep = []
        for name, t in named:
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue
            if name not in targets:
                raise BadInputError(f"tensor {name!r} is not a parameter of the served model")
            dest, _, rows = targets[name]
            want = (rows, *dest.shape[1:])
            if tuple(t.shape) != want:
                raise BadInputError(f"tensor {name!r} has shape {list(t.shape)}, the served model "
                                    f"expects {list(want)}")
            want_dtype = update_dtype if not isinstance(dest, torch.Tensor) else dest.dtype
            if not isinstance(t, (quant.BlockFp8, quant.Int4Tensor)) and t.dtype != want_dtype:
                raise BadInputError(f"tensor {name!r} has dtype {t.dtype}, the served model "
                                    f"takes {want_dtype}; send it as {want_dtype}")
            keep.append((name, t))
        return keep

    @torch.no_grad()
    def load_tensors(self, tensors: Iterable[tuple[str, torch.Tensor | quant.BlockFp8]]) -> int:
        """Copy named HF tensors into place (names already checked). Returns how many."""
        targets = self._targets()
        n = 0
        for name, t in tensors:
            if name not in targets:
                continue
            dest, start, rows = targets[name]
            quant.copy_into(dest, start, rows, t)
            n += 1
        return n

    def nbytes(self) -> int:
        tensors = {id(t): t for L in self.layers for t in L.values()}
        for t in (self.embed, self.lm_head, self.norm):
            tensors[id(t)] = t
        return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes()
                   for t in tensors.values())

    # ----- forward -------------------------------------------------------------------------

    def rope_table(self, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max_positions, D] in the model dtype, built once (CUDA graphs index it), on
        the model's device as transformers computes them (CPU and CUDA cos differ in last bits)."""
        if self._rope_cache is None or self._rope_cache[0].shape[0] < max_positions:
            t = torch.arange(max_positions, dtype=torch.float32, device=self.device)
            freqs = torch.outer(t, self._inv_freq.to(self.device))
            emb = torch.cat([freqs, freqs], dim=-1)
            self._rope_cache = ((emb.cos() * self._rope_scale).to(self.dtype),
                                (emb.sin() * self._rope_scale).to(self.dtype))
        return self._rope_cache

    def rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, *, k_cache: torch.Tensor | None = None,
                   v_cache: torch.Tensor | None = None, loc: torch.Tensor | None = None,
                   k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
        """Rotate q and k in place by their positions; write k, v into cache slots `loc`
        (quantized, their scales into `k_scale`/`v_scale`, for an FP8 cache)."""
        from rltool.engine import fused

        cos, sin = self.rope_table(self.spec.max_position_embeddings)
        fn = fused.rope_store if self.fused else fused.rope_store_ref
        fn(q, k, v, cos, sin, positions, k_cache=k_cache, v_cache=v_cache, loc=loc,
           k_scale=k_scale, v_scale=v_scale)

    def hidden(self, input_ids: torch.Tensor, attend: Attend,
               collect: list[torch.Tensor] | None = None,
               routed: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of a packed token stream. `attend` gets q, k, v
        before RoPE (it applies `rope_store`, so the cache write can be fused with it). `collect`
        receives transformers' `output_hidden_states`: the embeddings, each layer's output, the
        last one after the final norm. `routed` receives each sparse layer's expert ids [T, k], in
        layer order."""
        from rltool.engine import fused

        s = self.spec
        add_norm = fused.add_rms_norm if self.fused else fused.add_rms_norm_ref
        silu_mul = fused.silu_mul if self.fused else fused.silu_mul_ref
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        x = F.embedding(input_ids, self.embed)
        T = x.shape[0]
        # Residual stream as transformers adds it: residual = residual + sublayer output (in the
        # model dtype), each norm reading the updated residual. The norm or SiLU-mul before an
        # FP8 linear writes its output quantized for it (`fp8_input`).
        h, residual = add_norm(x, None, self.layers[0]["ln1"], s.rms_norm_eps,
                               fp8_input(self.layers[0]["qkv"]))
        if collect is not None:
            collect.append(x)
        for i, L in enumerate(self.layers):
            qkv = self._linear(i, "qkv", h, L.get("qkv_bias"))
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(T, s.num_heads, s.head_dim)
            k = k.view(T, s.num_kv_heads, s.head_dim)
            v = v.view(T, s.num_kv_heads, s.head_dim)
            if s.qk_norm:
                q = rms_norm(q, L["q_norm"], s.rms_norm_eps)
                k = rms_norm(k, L["k_norm"], s.rms_norm_eps)
            a = attend(i, q, k, v)
            if isinstance(a, torch.Tensor):  # else quantized for an FP8 o_proj already
                a = a.reshape(T, q_size)
            sparse = self._sparse(i)
            h, residual = add_norm(self._linear(i, "o", a), residual, L["ln2"], s.rms_norm_eps,
                                   None if sparse else fp8_input(L["gate_up"]))
            if sparse:
                m = moe.forward(h, L, s.moe, silu_mul, routed)
            else:
                m = self._linear(i, "down", silu_mul(self._linear(i, "gate_up", h),
                                                     fp8_input(L["down"])))
            if i + 1 < len(self.layers):
                after = self.layers[i + 1]
                h, residual = add_norm(m, residual, after["ln1"], s.rms_norm_eps,
                                       fp8_input(after["qkv"]))
            else:
                h, residual = add_norm(m, residual, self.norm, s.rms_norm_eps)
            if collect is not None:
                collect.append(residual if i + 1 < len(self.layers) else h)
        return h

    def _linear(self, layer: int, key: str, x: Any, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Linear `key` of `layer`, plus the LoRA adapter's update under --enable-lora."""
        y = linear(x, self.layers[layer][key], bias)
        return y if self.lora is None else self.lora.add(layer, key, x, y)

    def logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        """[N, hidden] -> logits [N, vocab], float32 unless `upcast` is off (model dtype)."""
        out = F.linear(hidden, self.lm_head)
        return out.float() if upcast else out


def fp8_input(w: torch.Tensor | quant.Fp8Weight) -> int | None:
    """The K-block to quantize a linear's input with when its weight is FP8 (else None)."""
    return w.block_k if isinstance(w, quant.Fp8Weight) else None


def load_model(model_dir: str | Path, *, device: torch.device | str, dtype: torch.dtype,
               spec: ModelSpec | None = None, fp8_resident: bool = False) -> DenseLM:
    """Build a DenseLM from a HF checkpoint directory (every tensor checked before any is kept).
    `fp8_resident`: keep the linears a block-FP8 or INT4 checkpoint stores quantized as they
    are (where the GEMMs take them: quant.resident_keys); otherwise they are dequantized into
    `dtype`."""
    model_dir = Path(model_dir)
    spec = spec or read_spec(model_dir)
    index = read_index(model_dir)
    keys: frozenset[tuple[int, str]] = frozenset()
    fmt = index.fmt
    if fp8_resident and fmt is not None:
        sources = DenseLM(spec, device="meta", dtype=dtype).fp8_sources()
        keys = quant.resident_keys(fmt, sources, index.shapes, index.fp8)
    int4 = fmt if isinstance(fmt, quant.Int4Format) else None
    model = DenseLM(spec, device=device, dtype=dtype, fp8_keys=keys, int4=int4,
                    fp8_block_k=fmt.block[1] if isinstance(fmt, quant.Fp8Format) else 128)
    load_checkpoint(model, model_dir, index=index)
    return model


