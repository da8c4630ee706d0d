"""The trainer backend protocol: what the train stage needs from a training engine.

A backend owns the model (and its optimizer, LR schedule position and RNG); the stage owns the
data, the algorithm and the loss. `torch` (rltool.train.torch_backend) and `megatron`
(rltool.train.megatron_backend) implement it; `build_backend` builds the one a config names. The
stage drives every rank in lockstep: the same number of `forward_logprobs` calls and one
`train_step` per optimizer step on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rltool.logprobs import logits_to_logprobs, scaled_logits
from rltool.train.algo.losses import entropy_from_logits

if TYPE_CHECKING:
    from rltool.train.config import BackendConfig


@dataclass
class MicroBatch:
    """Samples processed in one forward pass; `indices` name them in the caller's sample set.

    An empty micro-batch (a padding rank) still runs a forward so collectives stay in lockstep.
    """

    indices: list[int]
    tokens: list[list[int]]        # prompt + response ids per sample
    response_starts: list[int]     # first response position per sample
    # Rollout routing replay: per sample, the experts the engine routed its tokens to (int32
    # [tokens - 1, MoE layers x k], -1: none), replayed instead of the router's top-k; or None.
    routed_experts: list[Any] | None = None

    @property
    def empty(self) -> bool:
        return not self.indices

    def split(self) -> list["MicroBatch"]:
        routes = self.routed_experts or [None] * len(self.indices)
        return [MicroBatch([i], [t], [s], None if r is None else [r])
                for i, t, s, r in zip(self.indices, self.tokens, self.response_starts, routes)]


@dataclass
class ForwardOutput:
    """Per sample (in micro-batch order), over its response tokens."""

    logprobs: list[torch.Tensor]                    # [L] float32
    entropy: list[torch.Tensor] | None = None       # [L] float32
    topk_logprobs: list[torch.Tensor] | None = None  # [L, k]
    topk_ids: list[torch.Tensor] | None = None       # [L, k]
    extras: dict[str, Any] = field(default_factory=dict)  # "values" [L]; "logits" [L, V] raw


def token_outputs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                  with_entropy: bool, top_k: int) -> tuple[torch.Tensor, ...]:
    """Logits [L, V] that predict `targets` [L] -> their logprobs under rltool.logprobs'
    convention, then the entropy (with_entropy) and the top-k logprobs and ids (top_k > 0).
    Each output takes its own log-softmax of the logits: sharing one would change the order in
    which their gradients add up, and with it the trained weights' last bits."""
    out = [logits_to_logprobs(logits, targets, temperature=temperature)]
    if with_entropy:
        out.append(entropy_from_logits(logits, temperature=temperature))
    if top_k:
        out += torch.log_softmax(scaled_logits(logits, temperature=temperature),
                                 dim=-1).topk(top_k, dim=-1)
    return tuple(out)


def output_names(*, with_entropy: bool, top_k: int) -> list[str]:
    """The ForwardOutput fields that `token_outputs` fills, in its order."""
    return ["logprobs"] + (["entropy"] if with_entropy else []) + (
        ["topk_logprobs", "topk_ids"] if top_k else [])


def response_outputs(rows: torch.Tensor, targets: torch.Tensor, lengths: list[int], *,
                     temperature: float, with_entropy: bool, top_k: int) -> ForwardOutput:
    """`rows`: the logits [R, V] that predict the response tokens `targets` [R] of the samples,
    one after the other (`lengths` rows each, summing to R) -> their `token_outputs`, computed
    once over all rows and split per sample. Every backend builds its ForwardOutput from
    `token_outputs`, so all compute the same functions; each row's outputs (and the gradient they
    send back to it) are those of the row on its own."""
    names = output_names(with_entropy=with_entropy, top_k=top_k)
    parts = token_outputs(rows, targets, temperature=temperature, with_entropy=with_entropy,
                          top_k=top_k)
    out = ForwardOutput(logprobs=[])
    for name, value in zip(names, parts):
        setattr(out, name, list(value.split(lengths)))
    return out


# loss_fn(output, micro_batch) -> (scalar loss for backward, metrics as weighted sums). Losses are
# already normalised for the whole global batch, so micro-batch and rank contributions just add up.
LossFn = Callable[[ForwardOutput, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class TrainerBackend(Protocol):
    dp_rank: int
    dp_size: int
    optimizer_steps: int  # steps applied so far in this trainer lineage (drives the LR schedule)
    vocab_size: int       # the model's vocabulary (logit columns past it, e.g. TP padding, excluded)

    def forward_logprobs(self, batch: MicroBatch, *, temperature: float,
                         with_entropy: bool = False, top_k: int = 0,
                         with_logits: bool = False) -> ForwardOutput:
        """Logprobs of the response tokens under rltool.logprobs' convention, without grad;
        with_logits: also each response position's raw logits (extras["logits"])."""
        ...

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn, *, temperature: float,
                   with_entropy: bool = False, with_logits: bool = False) -> dict[str, float]:
        """Forward/backward every micro-batch, clip, one optimizer step; metrics summed over
        micro-batches and ranks, plus train/grad_norm and train/lr."""
        ...

    def save(self, ckpt_dir: Path, *, trainer_state: dict[str, Any],
             data_tensors: dict[str, torch.Tensor], config_toml: str) -> None:
        """Write a complete trainer checkpoint atomically (collective; rank 0 writes)."""
        ...

    def load(self, ckpt_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Restore optimizer, RNG and schedule position; return the stage's state and tensors."""
        ...

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors of the current policy (on rank 0; empty on the others)."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (a one-element list on a single process)."""
        ...


def build_backend(model_dir: str | os.PathLike, *, options: BackendConfig, trainable: bool = True,
                  value_head: bool = False) -> Any:
    """A TorchBackend or a MegatronBackend (a TrainerBackend) for `model_dir`, as
    `options.backend` (`torch`, `megatron`) names. The implementations are imported here, not at
    the top: each imports this module for its types, and megatron's loads megatron-core."""
    if options.recompute == "auto":  # a caller that did not plan: its cap, else 4,096 tokens
        from rltool.train.memfit import fit

        fitted = fit(options, model_dir)
        options = options.model_copy(update={k: v for k, v in fitted.items()
                                             if k in ("recompute", "logprob_chunk_tokens")})
    if options.backend == "megatron":
        from rltool.train.megatron_backend import MegatronBackend

        return MegatronBackend(model_dir, options=options, trainable=trainable,
                               value_head=value_head)
    from rltool.train.torch_backend import TorchBackend

    return TorchBackend(model_dir, options=options, trainable=trainable, value_head=value_head)
