"""Rollout routing replay (rltool.train.routing_replay) in the megatron backend.

megatron-core's TopKRouter asks its `router_replay` object for the top-k of every forward
(`get_replay_topk(scores, topk, ...)`, with the scores the top-k is taken over: the router
logits, or their softmax with `moe_router_pre_softmax`). `MegatronRouterReplay` puts an object
of its own there on every TopKRouter of the model: while a micro-batch's routes are set it
returns the replayed experts (the router's own where a token has none) and the scores gathered
at them, from which megatron computes the routing weights as it does for its own top-k (a
softmax over the gathered logits, renormalised probabilities with pre-softmax, the scaling
factor); otherwise megatron's own top-k. This is what slime does (its patch of the router's
top-k gathers the scores at the recorded indices).

Token rows: a micro-batch runs packed, its samples back to back and padded to the schedule's
length; under sequence parallelism each tensor-parallel rank routes its own contiguous slice.
Routes are set per micro-batch in the schedule's forward step; a backward that recomputes the
routers (full activation recompute) under a pipeline schedule, where later forwards run before
earlier backwards, is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from rltool.errors import ConfigError
from rltool.train.backend import MicroBatch
from rltool.train.routing_replay import token_routes


class _LayerReplay:
    """The `router_replay` of one TopKRouter (megatron-core's RouterReplay interface)."""

    def __init__(self, owner: "MegatronRouterReplay", layer: int):
        self.owner, self.layer = owner, layer

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        routes = self.owner.routes
        if routes is None:
            return own
        if routes.shape[0] != scores.shape[0]:
            raise RuntimeError(f"routing replay: {routes.shape[0]} routed tokens for a router "
                               f"input of {scores.shape[0]}")
        replay = routes[:, self.layer].to(scores.device)
        experts = torch.where(replay >= 0, replay, own[1])
        return scores.gather(1, experts), experts


class MegatronRouterReplay:
    """Installs the replay on every TopKRouter of `model` (a megatron GPTModel); `prepare`
    sets the routes of the micro-batch about to run."""

    def __init__(self, model: Any, options: Any, *, tp_rank: int):
        from megatron.core.transformer.moe.router import TopKRouter

        if options.recompute == "full" and options.pipeline_model_parallel_size > 1:
            raise ConfigError("--use-rollout-routing-replay with --recompute full "
                              "and --pipeline-model-parallel-size > 1 would recompute routers "
                              "after later micro-batches' forwards; drop one of them")
        config = model.config
        self.num_layers, self.top_k = int(config.num_layers), int(config.moe_router_topk or 0)
        self.tp_size = options.tensor_model_parallel_size if options.sequence_parallel else 1
        self.tp_rank = tp_rank if options.sequence_parallel else 0
        self.routes: torch.Tensor | None = None
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ConfigError("--use-rollout-routing-replay needs an MoE model; the model has "
                              "no routers (drop the flag)")
        for router in routers:  # layer_number: 1-based over the whole model (all stages)
            router.router_replay = _LayerReplay(self, router.layer_number - 1)

    def prepare(self, mb: MicroBatch, length: int, device: torch.device) -> None:
        """The routes of `mb` packed into `length` rows (padding: the router's own choice),
        this rank's slice of them under sequence parallelism; none without routes."""
        routes = token_routes(mb, num_layers=self.num_layers, top_k=self.top_k, device=device)
        if routes is None:
            self.routes = None
            return
        pad = routes.new_full((length - routes.shape[0], *routes.shape[1:]), -1)
        rows = length // self.tp_size
        self.routes = torch.cat([routes, pad])[self.tp_rank * rows:(self.tp_rank + 1) * rows]
