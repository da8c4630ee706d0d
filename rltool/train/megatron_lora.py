"""LoRA on the megatron backend (`--lora-rank R`): adapters on megatron-core's tensor-parallel
linears, published in PEFT's layout exactly as the torch backend's (rltool.train.lora).

Each HF target is one adapter, lora_A [r, in] and lora_B [out, r] of the HF module, on the
megatron linear that holds it:

- column-parallel (output rows split over TP): `self_attention.linear_qkv` (q_proj, k_proj,
  v_proj) and `mlp.linear_fc1` (gate_proj, up_proj). lora_A is replicated, lora_B split by its
  output rows like the weight. The adapters of a fused linear stay separate: their outputs are
  laid out as the fused weight's rows are (per query group: the group's q rows, its k rows, its
  v rows; gate rows then up rows), so exporting needs no re-mixing. h = x A^T passes megatron's
  copy-to-TP region: the same on every rank forwards, its gradient summed over TP backwards
  (each rank's lora_B shard gives a part), so lora_A's gradient is the full one on every rank.
- row-parallel (input columns split over TP): `self_attention.linear_proj` (o_proj) and
  `mlp.linear_fc2` (down_proj). lora_A is split by its input columns like the weight, lora_B
  replicated; the partial x A^T of each rank is summed over TP (reduce-from-TP region) before B.

The frozen base stays megatron's own module (`base`, requires_grad False): megatron's DDP and
optimizers (distributed optimizer included) see only the adapters, so gradients, fp32 masters
and Adam moments exist for them alone. The adapters are fp32 parameters; under bf16 they run in
bf16 like the base (no fp32 copy of a layer's input is kept for backward). Checkpoint keys keep the plain model's names for the base
(`...linear_qkv.weight`, through a load pre-hook) and add `...linear_qkv.lora_A.q_proj` etc.,
sharded as above, so dist/ checkpoints restore the adapters of every TP rank.

lora_A starts Kaiming-uniform (a = sqrt(5), PEFT's default) drawn for the whole HF matrix from a
generator seeded by (seed, layer, module) and then cut to the rank's shard, so every layout starts
from the same adapter; lora_B starts at zero. Pipeline stages adapt their own layers (global
layer numbers). MoE models take attention adapters only. Refused: the MLP targets of MoE
models (expert linears) and sequence parallelism (it does not run on the CPU here, so it is not
verified; docs/train.md).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rltool.errors import CheckpointError, ConfigError
from rltool.train import lora

HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
             "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# megatron linear of a TransformerLayer -> how TP splits it (its HF parts: _layer_parts)
PARALLEL = {"self_attention.linear_qkv": "column", "self_attention.linear_proj": "row",
            "mlp.linear_fc1": "column", "mlp.linear_fc2": "row"}
KEY_MARK = ".lora_"


def is_adapter_key(key: str) -> bool:
    """Whether a megatron (sharded) state key is an adapter tensor."""
    return KEY_MARK in key


def resolve_targets(targets: list[str]) -> list[str]:
    """The HF module names to adapt: `all-linear` is every one megatron can adapt."""
    if targets == [lora.ALL_LINEAR]:
        return list(HF_PARENT)
    unknown = [t for t in targets if t not in HF_PARENT]
    if unknown:
        raise ConfigError(f"--lora-target-modules {','.join(unknown)}: the megatron backend adapts "
                          f"{','.join(HF_PARENT)} (or {lora.ALL_LINEAR}); use those names or "
                          "--backend torch")
    return list(targets)


def check_layout(options: Any, hf_config: dict[str, Any]) -> None:
    """Refuse, in one line and before any model is built, what megatron LoRA does not cover."""
    from rltool.convert.gpt_model import num_experts

    mlp = [t for t in resolve_targets(list(options.lora_target_modules))
           if HF_PARENT[t] == "mlp"]
    if num_experts(hf_config) and mlp:
        raise ConfigError(f"--lora-target-modules {','.join(mlp)}: --backend megatron does not "
                          "adapt MoE experts; pass --lora-target-modules q_proj,k_proj,v_proj,"
                          "o_proj (attention only) or use --backend torch")
    if options.sequence_parallel:
        raise ConfigError("--lora-rank with --backend megatron runs without --sequence-parallel; "
                          "drop it")


@dataclass(frozen=True)
class Part:
    """One HF module inside a megatron linear: its name and full [out, in] shape."""

    name: str
    out_features: int
    in_features: int


def _init_a(shape: tuple[int, int], *, seed: int, layer: int, name: str) -> torch.Tensor:
    """The full lora_A of one HF module, the same on every rank and in every layout."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{layer}/{name}".encode()))
    a = torch.empty(shape, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
    return a


class LoraParallelLinear(torch.nn.Module):
    """A megatron column- or row-parallel linear with the adapters of its targeted HF parts
    (see the module docstring). `local_groups`: the row groups of the fused local output that
    each part's rows interleave by (a column linear's query groups on this rank; 1 otherwise)."""

    def __init__(self, base: torch.nn.Module, *, kind: str, parts: list[Part], targets: list[str],
                 owner: MegatronLoRA, layer: int, local_groups: int, seed: int):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        assert not getattr(base, "gather_output", False), "adapted linears keep TP-split outputs"
        self.base, self.kind, self.parts, self.owner = base, kind, parts, owner
        self.layer, self.local_groups = layer, local_groups
        self.targets = [p.name for p in parts if p.name in targets]
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        device = base.weight.device
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        r = owner.rank
        for part in parts:
            if part.name not in self.targets:
                continue
            a = _init_a((r, part.in_features), seed=seed, layer=layer, name=part.name)
            # fp32 parameters under --dtype bf16 too (megatron's optimizers keep them as their
            # own masters); the forward casts them to the activations' dtype, so the input x
            # the base's GEMM saves for backward is the one the adapter's saves too
            self.lora_A[part.name] = torch.nn.Parameter(self.shard(a, "lora_A").to(device))
            self.lora_B[part.name] = torch.nn.Parameter(
                self.shard(torch.zeros(part.out_features, r), "lora_B").to(device))
            split = self.lora_B[part.name] if kind == "column" else self.lora_A[part.name]
            set_tensor_model_parallel_attributes(split, is_parallel=True,
                                                 dim=0 if kind == "column" else 1, stride=1)
        self.dropout = (torch.nn.Dropout(owner.dropout) if owner.dropout
                        else torch.nn.Identity())
        self.register_load_state_dict_pre_hook(_base_keys)

    def shard(self, full: torch.Tensor, kind: str) -> torch.Tensor:
        """This TP rank's part of a full lora_A or lora_B: lora_B's rows (column-parallel) or
        lora_A's columns (row-parallel); the other one is replicated."""
        if (kind == "lora_B") == (self.kind == "column"):
            return full.chunk(self.tp, dim=0 if kind == "lora_B" else 1)[self.tp_rank].contiguous()
        return full

    def hf_path(self, name: str) -> str:
        """The transformers module path of the part `name` (`model.layers.3.self_attn.q_proj`)."""
        return f"model.layers.{self.layer}.{HF_PARENT[name]}.{name}"

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, bias = self.base(x, *args, **kwargs)
        if not self.owner.enabled:
            return out, bias
        update = self._column(x) if self.kind == "column" else self._row(x)
        return out + update, bias

    def _column(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        # x is the same on every TP rank: so is the dropout mask (the default generator, as
        # megatron's hidden dropout), and h
        a = torch.cat([self.lora_A[name] for name in self.targets]).to(x.dtype)
        h = copy_to_tensor_model_parallel_region(F.linear(self.dropout(x), a))
        h_parts = dict(zip(self.targets, h.split(self.owner.rank, dim=-1)))
        ys = []
        for part in self.parts:
            if part.name in h_parts:
                b = self.lora_B[part.name].to(h.dtype)
                y = F.linear(h_parts[part.name], b) * self.owner.scale
            else:  # an untargeted part of a fused linear adds nothing
                y = h.new_zeros(*h.shape[:-1], part.out_features // self.tp)
            ys.append(y.reshape(*y.shape[:-1], self.local_groups, -1))
        return torch.cat(ys, dim=-1).flatten(-2)

    def _row(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (get_cuda_rng_tracker,
                                                   reduce_from_tensor_model_parallel_region)

        (name,) = self.targets
        with get_cuda_rng_tracker().fork():  # x's columns differ per TP rank: so do the masks
            dropped = self.dropout(x)
        h = reduce_from_tensor_model_parallel_region(
            F.linear(dropped, self.lora_A[name].to(x.dtype)))
        return F.linear(h, self.lora_B[name].to(h.dtype)) * self.owner.scale

    def backward_dw(self) -> None:
        self.base.backward_dw()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """The base's entries under its own keys, then the adapters, split like the weight."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        split = "lora_B" if self.kind == "column" else "lora_A"
        axis = 0 if self.kind == "column" else 1
        adapters = {f"{kind}.{name}": params[name] for kind, params in
                    (("lora_A", self.lora_A), ("lora_B", self.lora_B)) for name in self.targets}
        out.update(make_sharded_tensors_for_checkpoint(
            adapters, prefix, {k: axis for k in adapters if k.startswith(split)},
            sharded_offsets, tp_group=self.base.tp_group,
            dp_cp_group=(metadata or {})["dp_cp_group"]))
        return out


def _base_keys(module: LoraParallelLinear, state_dict: dict[str, Any], prefix: str,
               *args: Any) -> None:
    """A checkpoint names the base's tensors as the plain model does (`<prefix>weight`); they
    live in the `base` child."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix):]
        if not rest.startswith(("base.", "lora_A.", "lora_B.")):
            state_dict[f"{prefix}base.{rest}"] = state_dict.pop(key)


class MegatronLoRA(lora.LoRA):
    """The adapters of one megatron GPTModel, with the torch backend's LoRA's face (`scale`,
    `paths`, `peft_config`, `describe`, `disabled`: inherited); its own constructor, since the
    torch one hooks nn.Linear modules where this one wraps megatron's parallel linears."""

    def __init__(self, model: Any, *, rank: int, alpha: float, dropout: float,
                 targets: list[str], seed: int, recompute: bool = False):
        """`recompute`: the layers rerun their forward in backward (megatron's reentrant
        checkpoint), whose output needs a gradient only if its input does: with the whole base
        frozen the first layer's input needs none, so the embedding's output is made to need one
        (as PEFT's enable_input_require_grads), else no adapter inside a checkpoint would train."""
        from megatron.core import parallel_state as ps

        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.scale = alpha / rank
        self.targets = targets
        self.enabled = True
        wanted = resolve_targets(targets)
        model.requires_grad_(False)
        self.paths: list[str] = []
        self.linears: list[LoraParallelLinear] = []
        # every adapter tensor of the whole model (all pipeline stages), HF name -> full shape
        self.shapes = {f"model.layers.{layer}.{HF_PARENT[p.name]}.{p.name}.{kind}.weight": shape
                       for layer in range(model.config.num_layers)
                       for parts in _layer_parts(model.config).values() for p in parts
                       if p.name in wanted
                       for kind, shape in (("lora_A", (rank, p.in_features)),
                                           ("lora_B", (p.out_features, rank)))}
        if recompute and getattr(model, "embedding", None) is not None:
            model.embedding.register_forward_hook(_output_needs_grad)
        tp = ps.get_tensor_model_parallel_world_size()
        for layer in model.decoder.layers:
            index = layer.layer_number - 1  # global (megatron counts from 1)
            for path, parts in _layer_parts(model.config).items():
                if not any(p.name in wanted for p in parts):
                    continue
                parent_path, _, attr = path.rpartition(".")
                parent = layer.get_submodule(parent_path)
                groups = model.config.num_query_groups // tp if path.endswith("linear_qkv") else 1
                linear = LoraParallelLinear(
                    getattr(parent, attr), kind=PARALLEL[path], parts=parts, targets=wanted,
                    owner=self, layer=index, local_groups=groups, seed=seed)
                parent.add_module(attr, linear)
                self.linears.append(linear)
                self.paths += [linear.hf_path(name) for name in linear.targets]

    def load(self, tensors: Mapping[str, torch.Tensor], *, where: Path) -> None:
        """A whole adapter (HF model names, as `adapter_tensors` gives them) into this rank's
        shards; refused unless its tensors are exactly these adapters' names and shapes."""
        theirs = {name: tuple(t.shape) for name, t in tensors.items()}
        if theirs != self.shapes:
            odd = sorted(set(theirs.items()) ^ set(self.shapes.items()))[0][0]
            raise CheckpointError(f"{where}: its tensors are not this model's adapters ({odd} "
                                  "differs or is missing); pass the adapter trained on this base")
        with torch.no_grad():
            for linear in self.linears:
                for name in linear.targets:
                    for kind, params in (("lora_A", linear.lora_A), ("lora_B", linear.lora_B)):
                        full = tensors[f"{linear.hf_path(name)}.{kind}.weight"]
                        params[name].copy_(linear.shard(full, kind))


def _output_needs_grad(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
    if torch.is_grad_enabled():
        output.requires_grad_(True)


def _layer_parts(config: Any) -> dict[str, list[Part]]:
    """The HF modules of each adaptable linear of a layer, with their full shapes."""
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    q_rows = config.num_attention_heads * config.kv_channels
    kv_rows = config.num_query_groups * config.kv_channels
    return {"self_attention.linear_qkv": [Part("q_proj", q_rows, hidden),
                                          Part("k_proj", kv_rows, hidden),
                                          Part("v_proj", kv_rows, hidden)],
            "self_attention.linear_proj": [Part("o_proj", hidden, q_rows)],
            "mlp.linear_fc1": [Part("gate_proj", ffn, hidden), Part("up_proj", ffn, hidden)],
            "mlp.linear_fc2": [Part("down_proj", hidden, ffn)]}


def for_backend(model: Any, options: Any) -> MegatronLoRA | None:
    """The adapters `options` (a BackendConfig that `check_layout` accepted) asks for on
    `model`, or None with LoRA off."""
    if not options.lora_rank:
        return None
    return MegatronLoRA(model, rank=options.lora_rank, alpha=options.lora_alpha_value,
                        dropout=options.lora_dropout, targets=list(options.lora_target_modules),
                        seed=options.seed, recompute=options.recompute != "none")


def adapter_tensors(slots: Mapping[tuple[str, tuple[int, ...]], torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
    """The adapter slots of a gathered megatron state (rltool.train.megatron_state.gather_slots)
    under the HF model's names (`model.layers.3.self_attn.q_proj.lora_A.weight`)."""
    out = {}
    for (key, index), tensor in slots.items():
        if not is_adapter_key(key):
            continue
        kind, name = key.rsplit(".", 2)[1:]
        out[f"model.layers.{index[0]}.{HF_PARENT[name]}.{name}.{kind}.weight"] = tensor
    return out
