"""The device and host memory of the colocated loop's phases on one GPU, and the offload policy
that makes them fit.

The torch trainer holds fp32 parameters (4 bytes each), fp32 gradients (4) and AdamW's two fp32
moments (8): 16 bytes a parameter, ~114 GiB for the 7B shapes. Between optimizer steps the
gradients are dead (the next step starts from `zero_grad(set_to_none=True)`), so every offload
frees them instead of moving them. What moves to pinned host memory during rollout and eval:

| `[loop] offload` | to host | stays on the device |
|---|---|---|
| `all` | parameters (4 B/param) and optimizer state (8 B/param) | nothing |
| `optimizer` | optimizer state (8 B/param) | the fp32 parameters (4 B/param) |
| `auto` | `all` when the host has room for it, else `optimizer` | |
| `none` | nothing (chosen explicitly, never by `auto`) | the trainer's whole state, beside the engines |

Each phase, predicted by `plan` (bytes; N parameters, T the micro-batch token cap):

- rollout: the trainer's part left on the device + the engine's weights (N x engine dtype) + a KV
  pool of `kv_tokens` (2 x layers x KV heads x head dim x engine dtype a token);
- train: 16 N of trainer state + the activations of one micro-batch: with activation recompute
  the layer inputs (layers x T x hidden x 4) and one layer's tensors recomputed for its backward,
  without it every layer's; plus one chunk of logits (`logprob_chunk_tokens` rows, the packed
  layout, recomputed in the backward pass) and the final hidden states.
- host: the pinned buffers of what moves, plus the engines' staged weights (N x engine dtype,
  rltool.loop.colocation) -- pinned, so the kernel cannot swap them.

Under LoRA (`lora_params` L > 0, `Shape.lora_params`) the N parameters of the base are frozen:
the trainer holds 4 (N + L) bytes of parameters, 4 L of gradients and 8 L of AdamW moments.

With `none` nothing alternates: every phase holds the trainer's 16 N, the engines' weights and a
KV pool of `kv_tokens` together, the train phase its activations besides; the host holds nothing.

The parameter, gradient, optimizer, weight and KV bytes are exact (tests/train/test_memplan.py
counts the parameters of the HF model); the activation bytes are an estimate (tensors the autograd
graph keeps, and as much again for their gradients), within the margin the GPU test states.
`choose` refuses a plan that does not fit with a one-line error naming the knob to turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rltool.errors import ConfigError

GIB = float(1 << 30)
OFFLOADS = ("all", "optimizer")  # `auto` tries them in this order
POLICIES = (*OFFLOADS, "none")
HOST_SHARE = 0.75  # pinned buffers take at most this share of the host memory available
DEVICE_RESERVE = 2 << 30  # CUDA context, allocator slack, library workspaces
ELEM = {"fp32": 4, "bf16": 2}
DENSE = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class Shape:
    """A dense decoder's shapes (the HF config's fields that size its memory)."""

    arch: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config: Any, *, arch: str | None = None) -> Shape:
        """From a HF config object or its dict (a preset of rltool.data.models)."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(
            config, k, d)
        arch = arch or str(get("model_type", "qwen2"))
        if arch not in DENSE:
            raise ConfigError(f"the memory plan covers dense models ({', '.join(DENSE)}), not "
                              f"{arch!r}; use [loop] offload = all or optimizer")
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        if get("vocab_size") is None:
            raise ConfigError("the model shape names no vocab_size; pass the tokenizer's")
        return cls(arch=arch, hidden=hidden, intermediate=int(get("intermediate_size")),
                   layers=int(get("num_hidden_layers")), heads=heads,
                   kv_heads=int(get("num_key_value_heads") or heads),
                   head_dim=int(get("head_dim") or hidden // heads), vocab=int(get("vocab_size")),
                   tied=bool(get("tie_word_embeddings", False)))

    @property
    def params(self) -> int:
        """Parameters, as HF builds the model: qwen2 has q/k/v biases, qwen3 q/k norms."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h
        if self.arch == "qwen2":
            layer += q + 2 * kv
        if self.arch == "qwen3":
            layer += 2 * self.head_dim
        heads = 1 if self.tied else 2
        return self.layers * layer + heads * self.vocab * h + h

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear of a decoder layer, by name."""
        h, q, kv, i = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim,
                       self.intermediate)
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_params(self, rank: int, targets: list[str] | tuple[str, ...]) -> int:
        """Parameters of rank-`rank` LoRA adapters (A [r, in] + B [out, r]) on the decoder
        layers' `targets` (names, or all-linear), as rltool.train.lora builds them."""
        linears = self.linears()
        names = list(linears) if list(targets) == ["all-linear"] else list(targets)
        unknown = [n for n in names if n not in linears]
        if unknown:
            raise ConfigError(f"--lora-target-modules {','.join(unknown)}: the memory plan knows "
                              f"the decoder linears {','.join(linears)}")
        return self.layers * sum(rank * sum(linears[n]) for n in names)

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * ELEM[dtype]


@dataclass(frozen=True)
class Plan:
    """The predicted bytes of every phase, by component; `offload` is the policy planned."""

    offload: str
    shape: Shape
    rollout: dict[str, int] = field(default_factory=dict)
    train: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)

    def peak(self, phase: str) -> int:
        return sum(getattr(self, phase).values())

    def summary(self) -> str:
        parts = [f"{phase} {self.peak(phase) / GIB:.1f} GiB ("
                 + ", ".join(f"{k} {v / GIB:.1f}" for k, v in getattr(self, phase).items()) + ")"
                 for phase in ("rollout", "train", "host")]
        return f"offload {self.offload}: " + "; ".join(parts)


def activation_bytes(shape: Shape, *, tokens: int, compute_dtype: str, recompute: bool,
                     logprob_chunk_tokens: int) -> dict[str, int]:
    """The train phase's activations for one micro-batch of `tokens` tokens (an estimate)."""
    a, h = ELEM[compute_dtype], shape.hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # One layer: normed inputs (fp32 and compute copies), q/k/v, attention out, MLP gate, up,
    # activation and product; as much again for their gradients in the backward pass.
    layer = 2 * tokens * ((2 * h + q + 2 * kv + q + h) * a + 2 * h * 4 + 4 * shape.intermediate
                          * a)
    out = {"layer_inputs": shape.layers * tokens * h * 4} if recompute else {}
    out["layers"] = layer if recompute else shape.layers * layer
    chunk = min(tokens, logprob_chunk_tokens)
    out["logits"] = chunk * shape.vocab * (2 * a + 8)  # logits, fp32 log-softmax, their grads
    out["final_hidden"] = 2 * tokens * h * (4 + a)
    return out


def plan(shape: Shape, *, offload: str, compute_dtype: str = "bf16", engine_dtype: str = "bf16",
         micro_batch_tokens: int, recompute: bool, logprob_chunk_tokens: int = 4096,
         kv_tokens: int, trainer: tuple[dict[str, int], dict[str, int]] | None = None,
         lora_params: int = 0) -> Plan:
    """Each phase's bytes under `offload` ("all", "optimizer" or "none"). `trainer`: the
    trainer's own (train step, resident state) bytes from another plan (the megatron backend's,
    or torch with master weights: rltool.train.memfit.trainer_bytes), for `none` only.
    `lora_params`: LoRA (`Shape.lora_params`): the base is frozen (its fp32 parameters, no
    gradients or moments), the adapters' parameters, gradients and moments besides."""
    if offload not in POLICIES:
        raise ConfigError(f"unknown offload {offload!r}; choose auto, {', '.join(POLICIES)}")
    n = shape.params
    trained = lora_params or n
    weights = n * ELEM[engine_dtype]
    state = {"params": 4 * (n + lora_params), "grads": 4 * trained, "optimizer": 8 * trained}
    engines = {"engine_weights": weights,
               "kv_pool": kv_tokens * shape.kv_bytes_per_token(engine_dtype)}
    if trainer is not None:
        assert offload == "none", "another backend's plan is planned without device offload"
        return Plan(offload=offload, shape=shape, rollout=dict(trainer[1]) | engines,
                    train=dict(trainer[0]) | engines, host={})
    rollout = {"none": dict(state),
               "optimizer": {"trainer_params": state["params"]}}.get(offload, {})
    rollout.update(engines)
    train = dict(state)
    train.update(activation_bytes(shape, tokens=micro_batch_tokens, compute_dtype=compute_dtype,
                                  recompute=recompute,
                                  logprob_chunk_tokens=logprob_chunk_tokens))
    if offload == "none":
        train.update(engines)
        return Plan(offload=offload, shape=shape, rollout=rollout, train=train, host={})
    host = {"optimizer": state["optimizer"]}
    if offload == "all":
        host["params"] = state["params"]
    host["staged_weights"] = weights
    return Plan(offload=offload, shape=shape, rollout=rollout, train=train, host=host)


def choose(shape: Shape, *, offload: str = "auto", device_bytes: int, host_bytes: int,
           **knobs: Any) -> Plan:
    """The plan of `offload` (auto: the first of OFFLOADS that fits) on a device of
    `device_bytes` and a host with `host_bytes` available; a one-line ConfigError naming the
    knob when none fits. `knobs`: `plan`'s keywords."""
    device_room = device_bytes - DEVICE_RESERVE
    host_room = int(host_bytes * HOST_SHARE)
    tried: list[Plan] = []
    for name in (OFFLOADS if offload == "auto" else (offload,)):
        p = plan(shape, offload=name, **knobs)
        tried.append(p)
        if p.peak("train") <= device_room and p.peak("rollout") <= device_room and \
                p.peak("host") <= host_room:
            return p
    p = tried[-1]

    def gib(b: float) -> str:
        return f"{b / GIB:.1f} GiB"

    if p.offload == "none":
        raise ConfigError(f"offload none keeps the trainer and the engines on the device "
                          f"together: {gib(max(p.peak('train'), p.peak('rollout')))} needed, the "
                          f"device has {gib(device_room)}; set [loop] offload = auto"
                          + ("" if knobs.get("trainer") is None else " (torch backend, fp32 "
                             "parameters) or lower [loop] min_kv_tokens, [train] "
                             "max_tokens_per_microbatch or set [train] recompute = \"full\" / "
                             "optimizer_cpu_offload = true"))
    if p.peak("train") > device_room:
        raise ConfigError(f"the train phase needs {gib(p.peak('train'))} of device memory, the "
                          f"device has {gib(device_room)}; lower [train] "
                          "max_tokens_per_microbatch or set [train] recompute = \"full\"")
    if p.peak("host") > host_room:
        raise ConfigError(f"offload {p.offload} needs {gib(p.peak('host'))} of pinned host "
                          f"memory, {HOST_SHARE:.0%} of the available is {gib(host_room)}; set "
                          "[loop] offload = optimizer or free host memory")
    raise ConfigError(f"the rollout phase needs {gib(p.peak('rollout'))} of device memory with "
                      f"offload {p.offload}, the device has {gib(device_room)}; set [loop] "
                      "offload = all or lower [loop] min_kv_tokens")


def host_available(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """Host memory available to this process: `meminfo`'s MemAvailable, capped by the cgroup's
    limit (a container's share) less what it uses besides its page cache, when it has one."""
    with open(meminfo) as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    try:
        with open(f"{cgroup}/memory.max") as f:
            limit = f.read().strip()
        with open(f"{cgroup}/memory.current") as f:
            used = int(f.read())
        with open(f"{cgroup}/memory.stat") as f:
            stat = dict(line.split() for line in f if line.strip())
    except OSError:
        return avail
    if limit == "max":
        return avail
    cache = int(stat.get("active_file", 0)) + int(stat.get("inactive_file", 0))
    return min(avail, int(limit) - used + cache)
