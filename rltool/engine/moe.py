"""The sparse MoE block of the qwen3_moe family for the engine's model (rltool.engine.dense_model).

Routing as transformers' Qwen3MoeTopKRouter: router logits in the model dtype, a softmax in
float32, the top-k experts per token, their weights renormalised to sum to one when
`norm_topk_prob`, then cast back to the model dtype.

Expert computation is grouped: the T x k (token, expert) pairs are sorted by expert (stable, so
tokens keep their order inside an expert), each expert that received tokens runs two GEMMs over
its contiguous slice (gate/up fused, then down), the outputs are scaled by their routing weights
and summed back per token in expert order (the order transformers adds them in). Cost per MoE
layer: one device-to-host copy of the E per-expert counts (the slice bounds), at most E pairs of
GEMMs over T x k rows in all, and a gather and a scatter-add of T x k rows. The host copy makes
the layer's work depend on the data, so a decode step with MoE layers is not captured in a CUDA
graph (rltool.engine.paged_runner runs it eagerly).

Weights: each expert's HF tensors (`mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`) are
slices of two stacked tensors per layer, `experts_gate_up` [E, 2I, H] and `experts_down`
[E, H, I] (kept in FP8 on CUDA when the checkpoint stores them so, rltool.engine.quant); the
router is `mlp.gate.weight` [E, H].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rltool.engine.quant import linear
from rltool.errors import CheckpointError


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    norm_topk_prob: bool
    sparse_layers: frozenset[int]  # the others run the dense MLP of `intermediate_size`


def read_moe_spec(cfg: dict[str, Any], num_layers: int, *, where: str) -> MoeSpec:
    """The MoE part of a qwen3_moe config.json."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    try:
        experts, top_k = int(experts), int(cfg["num_experts_per_tok"])
        inter = int(cfg["moe_intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: qwen3_moe config lacks num_experts, "
                              f"num_experts_per_tok or moe_intermediate_size ({e})") from e
    if not 0 < top_k <= experts:
        raise CheckpointError(f"{where}: num_experts_per_tok {top_k} must be in 1..{experts}")
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    sparse = frozenset(i for i in range(num_layers)
                       if i not in dense_only and (i + 1) % step == 0)
    return MoeSpec(num_experts=experts, top_k=top_k, intermediate_size=inter,
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse)


def allocate(spec: MoeSpec, hidden_size: int, empty: Callable[..., torch.Tensor]
             ) -> dict[str, torch.Tensor]:
    """One sparse layer's MLP tensors (router and stacked experts)."""
    E, inter = spec.num_experts, spec.intermediate_size
    return {"router": empty(E, hidden_size), "experts_gate_up": empty(E, 2 * inter, hidden_size),
            "experts_down": empty(E, hidden_size, inter)}


def targets(spec: MoeSpec, prefix: str, layer: dict[str, torch.Tensor]
            ) -> dict[str, tuple[torch.Tensor, int, int]]:
    """HF tensor name -> (destination, row offset, rows) for one sparse layer (`prefix` ends in
    'mlp.')."""
    inter = spec.intermediate_size
    gate_up, down = layer["experts_gate_up"], layer["experts_down"]
    out = {prefix + "gate.weight": (layer["router"], 0, spec.num_experts)}
    for j in range(spec.num_experts):
        e = f"{prefix}experts.{j}."
        out[e + "gate_proj.weight"] = (gate_up[j], 0, inter)
        out[e + "up_proj.weight"] = (gate_up[j], inter, inter)
        out[e + "down_proj.weight"] = (down[j], 0, down.shape[1])
    return out


def route(h: torch.Tensor, router: torch.Tensor, spec: MoeSpec
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] (model dtype) and expert ids [T, k] of each token."""
    logits = F.linear(h, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def forward(h: torch.Tensor, layer: dict[str, torch.Tensor], spec: MoeSpec,
            silu_mul: Callable[[torch.Tensor], torch.Tensor],
            routed: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The sparse MLP of one layer: h [T, H] -> [T, H] in h's dtype. `routed` receives the
    expert ids [T, k] the tokens were routed to (rollout routing replay)."""
    weights, experts = route(h, layer["router"], spec)
    if routed is not None:
        routed.append(experts)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // spec.top_k
    counts = torch.bincount(flat, minlength=spec.num_experts).tolist()  # the one host copy
    x = h.index_select(0, token)
    scale = weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros_like(h)
    gate_up, down = layer["experts_gate_up"], layer["experts_down"]
    start = 0
    for j, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        y = linear(silu_mul(linear(x[rows], gate_up[j])), down[j]) * scale[rows]
        out.index_add_(0, token[rows], y)
        start += n
    return out


class RoutedExperts:
    """The experts each token of the engine's KV pool was routed to, per sparse layer, indexed
    by KV slot (so a reused cached prefix keeps the routing it was computed with):
    [slots, sparse layers, k], int16 (int32 past 32,767 experts), on the pool's device."""

    def __init__(self, spec: MoeSpec, num_layers: int, *, slots: int, device: torch.device):
        self.spec, self.num_layers = spec, num_layers
        self.layers = sorted(spec.sparse_layers)
        self.ids = torch.zeros(slots, len(self.layers), spec.top_k, dtype=self.dtype(spec),
                               device=device)

    @staticmethod
    def make(spec: MoeSpec | None, num_layers: int, *, slots: int, device: torch.device
             ) -> "RoutedExperts | None":
        """The record of an MoE model's pool of `slots` tokens (None for a dense model)."""
        return None if spec is None else RoutedExperts(spec, num_layers, slots=slots,
                                                       device=device)

    @staticmethod
    def dtype(spec: MoeSpec) -> torch.dtype:
        return torch.int16 if spec.num_experts <= 2**15 else torch.int32

    @staticmethod
    def bytes_per_token(spec: MoeSpec | None) -> int:
        """Bytes of the record per pool token (0 for a dense model)."""
        if spec is None:
            return 0
        size = torch.empty((), dtype=RoutedExperts.dtype(spec)).element_size()
        return len(spec.sparse_layers) * spec.top_k * size

    @staticmethod
    def hidden(model: Any, ids: torch.Tensor, attend: Any, record: "RoutedExperts | None",
               slots: torch.Tensor) -> torch.Tensor:
        """`model.hidden(ids, attend)` (rltool.engine.dense_model), its routing recorded at the
        KV slots [T] of the tokens when `record` is given."""
        routed: list[torch.Tensor] | None = [] if record is not None else None
        hidden = model.hidden(ids, attend, routed=routed)
        if routed:
            record.ids[slots] = torch.stack(routed, dim=1).to(record.ids.dtype)
        return hidden

    def read(self, table: Any, rid: str, length: int) -> np.ndarray | None:
        """int32 [length, num_layers, k]: the experts of the first `length` tokens of request
        `rid` of the page table, -1 in dense layers (SGLang's layout of routed_experts); None
        once the KV of those tokens is no longer held."""
        entry = table.entries.get(rid)
        if entry is None or entry.length < length:
            return None
        slots = torch.tensor(table.slots(rid, 0, length), dtype=torch.long,
                             device=self.ids.device)
        out = np.full((length, self.num_layers, self.spec.top_k), -1, dtype=np.int32)
        out[:, self.layers] = self.ids[slots].cpu().numpy()
        return out
