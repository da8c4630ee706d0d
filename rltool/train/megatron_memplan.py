"""The device memory of one megatron training rank: what `--recompute auto`, the automatic
micro-batch token cap and the refusal before the model is built (rltool.train.memfit) weigh.

Bytes of one rank (N: the parameters this rank holds, from the model's shapes and the TP/PP/EP
layout exactly as rltool.convert.gpt_model builds them; B: N rounded as megatron's
DistributedDataParallel lays out its contiguous buffers):

| part | bytes | source |
|---|---|---|
| weights | N x 2 (bf16) or 4 (fp32); with the distributed optimizer B x that | the parameters, or the param buffer they become views of |
| grads | B x 4 | `main_grad` buffer: `grad_reduce_in_fp32`, one per (dense, expert) group |
| master weights | bf16 only: 4 per optimizer element | fp32 copies the optimizer steps (fp32 training steps the parameters themselves) |
| optimizer | 8 per optimizer element | Adam's exp_avg and exp_avg_sq, fp32 |

Optimizer elements: N; with `--use-distributed-optimizer` this rank's shard, B / DP (the dense
buffer over DP, the expert buffer over the expert-data-parallel size; exact at DP 1, where the
padding holds no state, and an upper bound of the busiest rank above). B: each parameter starts
at a multiple of 64 elements and each buffer ends at a multiple of lcm(DP, 128) with the
distributed optimizer (megatron-core 0.16 `_ParamAndGradBuffer`), B = N without it. With
`--optimizer-cpu-offload` (megatron's HybridDeviceOptimizer) the first `--optimizer-offload-
fraction` of the optimizer elements keep their fp32 master (fp32 runs too: a host copy of the
parameter), moments and a pinned fp32 gradient copy in host memory instead: 16 bytes an element
on the host, nothing on the device. Torch's Adam `step` counters (one scalar per tensor, host
memory) are not counted.

Under LoRA (`Lora`, rltool.train.megatron_lora) the N parameters of the base are frozen: megatron's
DistributedDataParallel buffers only parameters that take gradients, so the base's weights are
N x 2 or 4 bytes, unpadded, with no gradient, master or moments. The adapters are fp32
parameters that megatron's DDP and optimizers treat as the full model's above, with A the
adapters' elements of this rank and B their buffer: weights 4 A (4 B with the distributed
optimizer), grads 4 B, no masters in bf16 either (the optimizers step fp32 parameters
themselves), moments and offload per optimizer element. A's per-rank shards, per layer in
DistributedDataParallel's order (linear_proj, linear_qkv, linear_fc1, linear_fc2; in each the
lora_A of every targeted part, then the lora_B): a column-parallel linear's lora_A [r, in] whole
and lora_B [out / t, r]; a row-parallel linear's lora_A [r, in / t] and lora_B [out, r] whole.

Activations of one micro-batch of T packed tokens, in the compute dtype (a bytes an element),
per token and layer, as the local layer spec's autograd graph keeps them (rltool's flash or SDPA
core attention, no dropout, no sequence parallelism; h hidden, q = heads x head dim, kv = KV
heads x head dim, I the MLP width, t = TP). This is the count of Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models" (section 4.1, 34 s b h bytes a
layer plus 5 a s^2 b for the attention scores), redone for this layer: RMSNorm instead of
LayerNorm, grouped KV heads, a SwiGLU MLP of width I, RoPE, flash attention (no s^2 scores, a
float32 log-sum-exp per head) and no dropout masks:

    layer(T) = T x [a x (4 h + (3 q + 3 kv + 3 I) / t) + 4 x heads / t + 8]

4 h: the two norms' inputs and outputs (the outputs are the QKV and FC1 GEMM inputs); 3 q + 3 kv:
the QKV output (v lives in it), RoPE'd q and k, the attention output (the projection's input);
3 I: the FC1 output (the SwiGLU input) and the SwiGLU output (the FC2 input); the float32
attention log-sum-exp and the two norms' reciprocal RMS. qwen3's q/k norms add a (q + kv) / t.
An MoE layer replaces 3 I / t by top-k x (h + 3 I_moe / t_e) (each routed copy, its FC1 and SwiGLU
outputs). LoRA adds per adapted linear the adapters' h = x A^T of each targeted part, T x r x a
(its input x is the one the formula counts), with `--lora-dropout` the dropped input and its
mask, T x in x (a + 1) (CUDA's fused dropout keeps a bool mask), and per layer the adapters'
copies the forward casts and keeps (bf16: every adapter of the layer, 2 bytes an element; fp32:
the concatenated lora_A of each column-parallel linear, 4). Counted in every layer, though the
first layer's linear_qkv keeps no lora_A copy or mask (its input needs no gradient); and the
frozen base's GEMMs keep no input, so a linear without adapters saves its input only where
another tensor holds it: neither is subtracted (an upper bound).
The recompute choices keep:

- none: every layer, L_stage x layer(T);
- selective (megatron's core-attention checkpoint): the same less the log-sum-exp, since the
  flash core attention keeps no s^2 scores; so selective saves almost nothing here;
- full (uniform, one layer a chunk): each layer's input, L_stage x T x h x a, and one layer
  recomputed in the backward pass, layer(T).

Every choice adds the backward pass's gradients at one layer, T x a x (3 h + 3 I / t), the final
hidden states (the last norm's input and output, the response rows gathered for the LM head),
3 T h a, and one chunk of logits (`--logprob-chunk-tokens` rows c = min(T, chunk), recomputed in
the backward pass): c x V x (2 a + 12), the bf16 logits and their gradient and three float32
[c, V] temporaries (log-softmax, its exponent, the gradient). With pipeline parallelism the
first stage holds the activations of PP micro-batches in flight (1F1B), the last stage one, and
the plan is the larger of the two. The activation bytes are an estimate; tests/gpu/
test_gpu_megatron_memplan.py compares the whole plan with the measured peak.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rltool.errors import ConfigError

GIB = float(1 << 30)
ELEM = {"fp32": 4, "bf16": 2}
VOCAB_MULTIPLE = 128  # rltool.convert.gpt_model.VOCAB_MULTIPLE (not imported: no torch here)
RECOMPUTES = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a HF config.json that size a megatron rank's memory."""

    arch: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0
    topk: int = 0
    moe_intermediate: int = 0

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> ModelShape:
        arch = str(config.get("model_type", "qwen2"))
        if arch not in ("qwen2", "qwen3", "llama", "qwen3_moe"):
            raise ConfigError(f"the megatron memory plan covers qwen2, qwen3, llama and qwen3_moe, "
                              f"not {arch!r}; set --recompute and --max-tokens-per-microbatch "
                              "explicitly")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        return cls(arch=arch, hidden=hidden, intermediate=int(config["intermediate_size"]),
                   layers=int(config["num_hidden_layers"]), heads=heads,
                   kv_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or hidden // heads),
                   vocab=int(config["vocab_size"]),
                   tied=bool(config.get("tie_word_embeddings", False)), experts=experts,
                   topk=int(config.get("num_experts_per_tok") or 0) if experts else 0,
                   moe_intermediate=int(config.get("moe_intermediate_size") or 0)
                   if experts else 0)

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Layout:
    """A rank's parallel layout; `etp` defaults to TP, as megatron's."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    dp: int = 1
    distributed_optimizer: bool = False

    @classmethod
    def of(cls, options: Any, *, world_size: int) -> Layout:
        """From a BackendConfig's megatron options and the number of ranks."""
        tp, pp = options.tensor_model_parallel_size, options.pipeline_model_parallel_size
        cp = options.context_parallel_size
        return cls(tp=tp, pp=pp, ep=options.expert_model_parallel_size,
                   etp=options.expert_tensor_parallel_size,
                   dp=max(world_size // (tp * pp * cp), 1),
                   distributed_optimizer=options.use_distributed_optimizer)

    @property
    def expert_dp(self) -> int:
        """The data-parallel size of expert parameters: DP x TP / (EP x ETP)."""
        return max(self.dp * self.tp // (self.ep * (self.etp or self.tp)), 1)


@dataclass(frozen=True)
class Lora:
    """The adapters of `--lora-rank`: rank, the targeted HF modules (resolved names, as
    rltool.train.megatron_lora.resolve_targets gives them) and the dropout."""

    rank: int
    targets: tuple[str, ...]
    dropout: float = 0.0


# megatron linear in DistributedDataParallel's order: (TP split, its HF parts)
LORA_LINEARS = {"linear_proj": ("row", ("o_proj",)), "linear_qkv": ("column", ("q_proj", "k_proj",
                                                                               "v_proj")),
                "linear_fc1": ("column", ("gate_proj", "up_proj")),
                "linear_fc2": ("row", ("down_proj",))}


def lora_linears(shape: ModelShape, layout: Layout, lora: Lora
                 ) -> list[tuple[str, int, list[int], list[int]]]:
    """One layer's adapted linears on a rank: (TP split, local input width, the element counts of
    its lora_A and of its lora_B shards, one per targeted part)."""
    t, h, r = layout.tp, shape.hidden, lora.rank
    q, kv, i = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    full = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}  # (out, in)
    out = []
    for kind, parts in LORA_LINEARS.values():
        names = [n for n in parts if n in lora.targets]
        if not names:
            continue
        if kind == "column":
            out.append((kind, h, [r * full[n][1] for n in names],
                        [full[n][0] // t * r for n in names]))
        else:
            out.append((kind, full[names[0]][1] // t, [r * full[n][1] // t for n in names],
                        [full[n][0] * r for n in names]))
    return out


def adapter_params(shape: ModelShape, layout: Layout, lora: Lora, *, stage: str) -> list[int]:
    """The element counts of one rank's adapter parameters on `stage`, in the order megatron's
    DistributedDataParallel meets them (the order its buffer padding depends on)."""
    layer = [n for _, _, a, b in lora_linears(shape, layout, lora) for n in a + b]
    return layer * math.ceil(shape.layers / layout.pp)


def local_params(shape: ModelShape, layout: Layout, *, stage: str) -> tuple[list[int], list[int]]:
    """The element counts of one rank's (dense, expert) parameters on the pipeline `stage`
    ("first" or "last"; the same rank when PP is 1), in GPTModel's order."""
    tp, h, d = layout.tp, shape.hidden, shape.head_dim
    vocab = math.ceil(shape.vocab / (VOCAB_MULTIPLE * tp)) * VOCAB_MULTIPLE * tp // tp
    q, kv = shape.heads * d // tp, shape.kv_heads * d // tp
    first, last = stage == "first" or layout.pp == 1, stage == "last" or layout.pp == 1
    dense: list[int] = [vocab * h] if first else []
    expert: list[int] = []
    for _ in range(math.ceil(shape.layers / layout.pp)):
        dense += [h, h * q, (q + 2 * kv) * h] + ([q + 2 * kv] if shape.qkv_bias else [])
        dense += [d, d] if shape.qk_norm else []
        dense.append(h)
        if shape.experts:
            etp = layout.etp or tp
            dense.append(shape.experts * h)  # the router, replicated
            for _ in range(shape.experts // layout.ep):
                expert += [2 * shape.moe_intermediate // etp * h, h * shape.moe_intermediate // etp]
        else:
            dense += [2 * shape.intermediate // tp * h, h * shape.intermediate // tp]
    if last:
        dense.append(h)
        if not shape.tied or layout.pp > 1:  # a tied head's copy on the last stage
            dense.append(vocab * h)
    return dense, expert


def buffer_numel(numels: list[int], *, dp: int, distributed_optimizer: bool) -> int:
    """Elements of megatron's contiguous param/grad buffer for these parameters (one bucket:
    `overlap_grad_reduce` is off): without the distributed optimizer their sum; with it each
    parameter (built in reverse order) starts at a multiple of 64 and the end is padded to a
    multiple of lcm(DP, 128)."""
    if not numels:
        return 0
    if not distributed_optimizer:
        return sum(numels)
    end = 0
    for n in reversed(numels):
        end = math.ceil(end / 64) * 64 + n
    divisor = math.lcm(dp, 128)
    return math.ceil(end / divisor) * divisor


def state_bytes(shape: ModelShape, layout: Layout, *, dtype: str, stage: str = "last",
                offload_fraction: float = 0.0, lora: Lora | None = None
                ) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) bytes of weights, grads, master weights and optimizer state of one rank;
    `offload_fraction`: the share of the optimizer elements stepped on the host
    (`--optimizer-cpu-offload`); `lora`: the base frozen, the adapters trained."""
    dense, expert = local_params(shape, layout, stage=stage)
    opt = layout.distributed_optimizer
    weights = grads = elements = 0
    trained = ((adapter_params(shape, layout, lora, stage=stage), layout.dp),) if lora else (
        (dense, layout.dp), (expert, layout.expert_dp))
    elem = 4 if lora else ELEM[dtype]  # the adapters are fp32 parameters
    if lora:
        weights = (sum(dense) + sum(expert)) * ELEM[dtype]
    for numels, group_dp in trained:
        n = sum(numels)
        buffer = buffer_numel(numels, dp=group_dp, distributed_optimizer=opt)
        weights += (buffer if opt else n) * elem
        grads += buffer * 4
        elements += (n if group_dp == 1 else math.ceil(buffer / group_dp)) if opt else n
    host_elements = math.ceil(elements * offload_fraction)
    device_elements = elements - host_elements
    device = {"weights": weights, "grads": grads}
    if elem == 2 and device_elements:  # bf16 trained parameters step fp32 masters
        device["master_weights"] = 4 * device_elements
    if device_elements:
        device["optimizer"] = 8 * device_elements
    host = {"optimizer": 16 * host_elements} if host_elements else {}
    return device, host


def lora_layer_bytes(shape: ModelShape, layout: Layout, lora: Lora, *, tokens: int,
                     dtype: str) -> int:
    """What one layer's adapters add to its saved activations (the module docstring)."""
    a, out = ELEM[dtype], 0
    for kind, width, a_numels, b_numels in lora_linears(shape, layout, lora):
        out += tokens * len(a_numels) * lora.rank * a
        out += tokens * width * (a + 1) if lora.dropout else 0
        if dtype == "fp32":
            out += 4 * sum(a_numels) if kind == "column" else 0
        else:
            out += a * (sum(a_numels) + sum(b_numels))
    return out


def layer_bytes(shape: ModelShape, layout: Layout, *, tokens: int, dtype: str,
                recompute: str, lora: Lora | None = None) -> int:
    """One layer's saved activations for `tokens` tokens (the module docstring's layer(T))."""
    a, t, h = ELEM[dtype], layout.tp, shape.hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if shape.experts:
        mlp = shape.topk * (h + 3 * shape.moe_intermediate // (layout.etp or t))
    else:
        mlp = 3 * shape.intermediate // t
    elems = 4 * h + (3 * q + 3 * kv) // t + mlp + ((q + kv) // t if shape.qk_norm else 0)
    lse = 0 if recompute == "selective" else 4 * shape.heads // t
    adapters = lora_layer_bytes(shape, layout, lora, tokens=tokens, dtype=dtype) if lora else 0
    return tokens * (a * elems + lse + 8) + adapters


def activation_bytes(shape: ModelShape, layout: Layout, *, tokens: int, dtype: str,
                     recompute: str, logprob_chunk_tokens: int, stage: str = "last",
                     lora: Lora | None = None) -> dict[str, int]:
    """The activations of one micro-batch of `tokens` tokens on `stage` (module docstring)."""
    if recompute not in RECOMPUTES:
        raise ConfigError(f"unknown recompute {recompute!r}; choose {', '.join(RECOMPUTES)}")
    a, h, t = ELEM[dtype], shape.hidden, layout.tp
    layers = math.ceil(shape.layers / layout.pp)
    in_flight = layout.pp if stage == "first" and layout.pp > 1 else 1
    layer = layer_bytes(shape, layout, tokens=tokens, dtype=dtype, recompute=recompute,
                        lora=lora)
    if recompute == "full":
        out = {"layer_inputs": in_flight * layers * tokens * h * a, "layers": layer}
    else:
        out = {"layers": in_flight * layers * layer}
    inter = shape.topk * shape.moe_intermediate if shape.experts else shape.intermediate
    out["backward"] = tokens * a * (3 * h + 3 * inter // t)
    if stage == "last" or layout.pp == 1:
        chunk = min(tokens, logprob_chunk_tokens)
        out["final_hidden"] = 3 * tokens * h * a
        out["logits"] = chunk * shape.vocab * (2 * a + 12)
    return out


@dataclass(frozen=True)
class MegatronPlan:
    """One rank's predicted device bytes by part, and the host bytes of an optimizer offload."""

    recompute: str
    micro_batch_tokens: int
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    def summary(self) -> str:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.device.items())
        host = f"; host {sum(self.host.values()) / GIB:.1f} GiB" if self.host else ""
        return (f"recompute {self.recompute}, {self.micro_batch_tokens} tokens a micro-batch: "
                f"device {self.device_bytes / GIB:.1f} GiB ({parts}){host}")


def plan(shape: ModelShape, layout: Layout, *, dtype: str, recompute: str,
         micro_batch_tokens: int, logprob_chunk_tokens: int = 4096,
         offload_fraction: float = 0.0, lora: Lora | None = None) -> MegatronPlan:
    """The busiest rank's bytes: the larger of the first and last pipeline stage; `lora`: the
    adapters of `--lora-rank` (None: full training)."""
    best: MegatronPlan | None = None
    for stage in (("first", "last") if layout.pp > 1 else ("last",)):
        device, host = state_bytes(shape, layout, dtype=dtype, stage=stage,
                                   offload_fraction=offload_fraction, lora=lora)
        device.update(activation_bytes(shape, layout, tokens=micro_batch_tokens, dtype=dtype,
                                       recompute=recompute, stage=stage, lora=lora,
                                       logprob_chunk_tokens=logprob_chunk_tokens))
        p = MegatronPlan(recompute=recompute, micro_batch_tokens=micro_batch_tokens,
                         device=device, host=host)
        if best is None or p.device_bytes > best.device_bytes:
            best = p
    assert best is not None
    return best
