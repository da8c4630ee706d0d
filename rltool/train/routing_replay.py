"""Rollout routing replay (R3) for MoE models: the trainer routes every token to the experts the
engine routed it to during the rollout, instead of its own router's top-k, so that the experts
behind a recomputed logprob are the ones behind the sampled token; the routing weights still
come from the trainer's own router (a softmax over its logits, gathered at the replayed experts,
renormalised as the model's router does), so the router keeps its gradient. This is what slime
does (its routing replay keeps the recorded top-k indices and gathers the scores at them).

A sample's routes (the shard's rollout_routed_experts, docs/formats.md) are int32 [T - 1,
layers x k] with -1 where there is none (a dense layer, a token the engine did not route); the
last token has none, since its logits predict nothing that is trained on. A token without a
route keeps the router's own choice.

`token_routes` lays a micro-batch's routes out in the row order of a forward's tokens; the torch
backend installs `HFRouterReplay` on a transformers qwen3_moe model, the megatron backend
rltool.train.megatron_routing on megatron-core's TopKRouter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rltool.errors import BadInputError, ConfigError
from rltool.train.backend import MicroBatch


def token_routes(mb: MicroBatch, *, num_layers: int, top_k: int, device: torch.device,
                 width: int | None = None) -> torch.Tensor | None:
    """int64 [rows, num_layers, top_k]: the replayed experts of a forward's token rows, sample
    by sample, each sample's T tokens padded with -1 to `width` rows (the padded layout) or not
    (width None: one sample, or samples packed into one row). None without routes."""
    if mb.empty or mb.routed_experts is None:
        return None
    blocks = []
    for index, tokens, routes in zip(mb.indices, mb.tokens, mb.routed_experts):
        want = (len(tokens) - 1, num_layers * top_k)
        if routes is None or tuple(routes.shape) != want:
            got = "none" if routes is None else f"shape {list(routes.shape)}"
            raise BadInputError(f"rollout routing replay: sample {index} has routed experts of "
                                f"{got}, the model needs [{want[0]}, {want[1]}] (tokens - 1, "
                                f"{num_layers} layers x top-{top_k}); were the rollouts made "
                                "with this model?")
        block = torch.full((width or len(tokens), want[1]), -1, dtype=torch.long)
        block[:want[0]] = torch.from_numpy(routes)
        blocks.append(block)
    return torch.cat(blocks).view(-1, num_layers, top_k).to(device)


def replayed_routing(logits: torch.Tensor, own: torch.Tensor, replay: torch.Tensor, *,
                     norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, experts [T, k]) of one MoE layer: the replayed
    experts where given (else the router's own), weighted by the router's softmax over all
    experts gathered at them (renormalised to sum to one with norm_topk_prob), as transformers'
    Qwen3MoeTopKRouter weights its own top-k."""
    experts = torch.where(replay >= 0, replay, own)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


class HFRouterReplay:
    """Forward hooks on the routers (`mlp.gate`) of a transformers qwen3_moe model that, while
    `replaying(routes)` holds routes, replace each router's (logits, weights, experts) with the
    replayed routing of its layer. The hooks stay installed; outside `replaying` they return
    the router's own output. Activation checkpointing reruns the hooks during backward, which
    must therefore run inside the same `replaying` block."""

    def __init__(self, model: Any):
        self.routes: torch.Tensor | None = None
        config = model.config
        self.num_layers = int(config.num_hidden_layers)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        layers = getattr(model, model.base_model_prefix).layers
        routers = [(i, layer.mlp.gate) for i, layer in enumerate(layers)
                   if hasattr(getattr(layer.mlp, "gate", None), "top_k")]
        if not routers:
            raise ConfigError(f"--use-rollout-routing-replay needs an MoE model; "
                              f"{type(model).__name__} has no routers (drop the flag)")
        for i, router in routers:
            router.register_forward_hook(self._hook(i))

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> Any:
            if self.routes is None:
                return output
            logits, _, own = output
            if self.routes.shape[0] != logits.shape[0]:
                raise RuntimeError(f"routing replay: {self.routes.shape[0]} routed tokens for a "
                                   f"forward of {logits.shape[0]}")
            weights, experts = replayed_routing(logits, own, self.routes[:, layer],
                                                norm_topk_prob=module.norm_topk_prob)
            return logits, weights, experts

        return hook

    @contextlib.contextmanager
    def replaying(self, mb: MicroBatch, *, device: torch.device,
                  width: int | None = None) -> Iterator[None]:
        """Replay `mb`'s routes (its token layout: `token_routes`) in the forwards and backwards
        run inside the block; without routes, the routers route."""
        self.routes = token_routes(mb, num_layers=self.num_layers, top_k=self.top_k,
                                   device=device, width=width)
        try:
            yield
        finally:
            self.routes = None
