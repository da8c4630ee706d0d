"""The `megatron` trainer backend: megatron-core's GPTModel with TP/PP/EP and packed sequences.

- The model is the one `rltool convert` builds (rltool.convert.gpt_model, local layer spec with
  rltool's SDPA core attention, or the transformer-engine spec), filled from the HF weights of
  `--load` (each rank its own shards) or from a megatron trainer checkpoint.
- Layout flags carry Megatron-LM's names (rltool.train.megatron_config); ranks come from torchrun.
  The data-parallel size is world / (TP * PP * CP); the DP schedule of rltool.train.dp_schedule
  assigns micro-batches to DP ranks exactly as for the torch backend.
- A micro-batch runs packed (THD): its samples back to back in one [1, T] row, positions restarting
  per sample, `PackedSeqParams` delimiting them (attention and RoPE never cross a boundary). The
  logits are gathered over TP, cut to the real vocabulary and turned into logprobs by
  rltool.train.backend.response_outputs, the function the torch backend uses.
- Forward and backward run through megatron's pipeline schedules (`get_forward_backward_func`),
  one call per logprob micro-batch and one per optimizer step, with `calculate_per_token_loss`:
  the stage's losses are already normalised for the global batch, so the schedule divides by
  nothing and megatron's DDP sums gradients over DP ranks instead of averaging them.
- Optimizer: megatron's (Adam with decoupled weight decay, global-norm clipping over all model
  parallel ranks, fp32 master weights with bf16, optionally the distributed optimizer), its
  learning rate set each step from rltool.train.lr like the torch backend.
- Checkpoints and the HF export: rltool.train.megatron_state.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rltool.errors import CheckpointError, ConfigError
from rltool.train import megatron_state
from rltool.train.backend import ForwardOutput, LossFn, MicroBatch, response_outputs
from rltool.train.config import BackendConfig
from rltool.train.lr import lr_of

log = logging.getLogger(__name__)


def _sizes(options: BackendConfig) -> dict[str, int]:
    return dict(tp=options.tensor_model_parallel_size, pp=options.pipeline_model_parallel_size,
                ep=options.expert_model_parallel_size, cp=options.context_parallel_size,
                etp=options.expert_tensor_parallel_size or options.tensor_model_parallel_size)


def _config_overrides(options: BackendConfig, *, cuda: bool) -> dict[str, Any]:
    """TransformerConfig fields the trainer sets on top of the converter's model config."""
    from megatron.core.distributed import finalize_model_grads

    def finalize(model: Any, num_tokens: Any = None, **kwargs: Any) -> None:
        # the losses are normalised already: reduce gradients, never divide by a token count
        finalize_model_grads(model, num_tokens=None, **kwargs)

    overrides: dict[str, Any] = dict(
        context_parallel_size=options.context_parallel_size,
        expert_tensor_parallel_size=_sizes(options)["etp"],
        sequence_parallel=options.sequence_parallel, calculate_per_token_loss=True,
        finalize_model_grads_func=finalize,
        use_cpu_initialization=not cuda,
        # HF's forward (the torch backend, the engines) adds no load-balancing loss
        moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    if options.recompute_granularity != "none":
        overrides["recompute_granularity"] = options.recompute_granularity
        if options.recompute_granularity == "full":
            overrides.update(recompute_method="uniform", recompute_num_layers=1)
    return overrides


class MegatronBackend:
    """See the module docstring; implements rltool.train.backend.TrainerBackend."""

    def __init__(self, model_dir: str | os.PathLike, *, options: BackendConfig,
                 trainable: bool = True, value_head: bool = False):
        from rltool import megatron_compat
        from rltool.convert.gpt_model import build_gpt_model, padded_vocab_size

        if value_head:
            raise ConfigError("--backend megatron has no value head (ppo); use --backend torch")
        self.options, self.trainable = options, trainable
        self.model_dir = Path(model_dir)
        cuda = torch.cuda.is_available()
        if options.device == "cuda" and not cuda:
            raise ConfigError("--device cuda but no CUDA device is visible; use --device auto or "
                              "cpu")
        if options.device == "cpu" and cuda:
            raise ConfigError("--backend megatron uses the GPUs when CUDA is visible (its process "
                              "groups are NCCL); use --device auto, or hide the GPUs")
        if trainable and not cuda and (options.use_distributed_optimizer
                                       or options.dtype != "fp32"):
            raise ConfigError("--use-distributed-optimizer and --dtype bf16 need CUDA with "
                              "--backend megatron (megatron-core's distributed and mixed-precision "
                              "optimizers check for CUDA tensors); use fp32 without it on the CPU")
        megatron_compat.init_distributed(**_sizes(options), seed=options.seed)
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(
            "cpu")
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.optimizer_steps = 0
        try:
            self.hf_config = json.loads((self.model_dir / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{model_dir}: unreadable config.json ({e})") from e
        self.vocab_size = int(self.hf_config["vocab_size"])
        tp = options.tensor_model_parallel_size
        dtype = torch.bfloat16 if options.dtype == "bf16" else torch.float32
        model = build_gpt_model(
            self.hf_config, tp=tp, pp=options.pipeline_model_parallel_size,
            ep=options.expert_model_parallel_size, params_dtype=dtype,
            vocab_size=padded_vocab_size(self.vocab_size, tp=tp),
            # megatron marks TP-sharded parameters (what the grad norm counts once per TP rank)
            # only while initializing them; the loaded weights replace these values
            perform_initialization=True,
            core_attention=self._core_attention(), **_config_overrides(options, cuda=cuda))
        if cuda:
            model = model.cuda()
        megatron_state.load_hf_weights(model, self.model_dir)
        self.config = model.config
        self.module = model
        self.model: Any = model
        self.optimizer: Any = None
        if trainable:
            self._wrap_and_optimizer(dtype)
        else:
            model.requires_grad_(False)

    def _core_attention(self) -> type:
        """rltool's SDPA core attention, after refusing what the local spec cannot run."""
        from rltool.train.megatron_attention import SdpaCoreAttention

        if self.options.sequence_parallel and importlib.util.find_spec("apex") is None:
            raise ConfigError("--sequence-parallel needs apex's fused norms with the local spec "
                              "(megatron's torch-norm fallback refuses it); install apex or drop "
                              "--sequence-parallel")
        if self.options.transformer_impl == "transformer_engine":
            raise ConfigError("--transformer-impl transformer_engine is not wired into the model "
                              "provider yet; use --transformer-impl local")
        return SdpaCoreAttention

    def _wrap_and_optimizer(self, dtype: torch.dtype) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.options
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=o.use_distributed_optimizer, check_for_nan_in_grad=False)
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config,
                                             module=self.module)
        opt_config = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
            # megatron clips only with clip_grad > 0; an infinite bound reports the norm unclipped
            clip_grad=o.clip_grad if o.clip_grad > 0 else math.inf,
            bf16=dtype == torch.bfloat16, params_dtype=dtype,
            use_distributed_optimizer=o.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])

    # -- collectives -------------------------------------------------------------------------
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` in global rank order (model-parallel peers give equal copies)."""
        if dist.get_world_size() == 1:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def _is_output_rank(self) -> bool:
        """The one rank per DP replica whose metrics count: last stage, TP and CP rank 0."""
        ps = self.ps
        return (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0)

    def _lockstep(self, units: list[MicroBatch]) -> list[MicroBatch]:
        """Pad with empty units to the same count on every rank (expert-parallel dispatch and the
        pipeline's sends pair up passes across ranks)."""
        count = torch.tensor([len(units)], dtype=torch.long, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return units + [MicroBatch([], [], [])] * (max(int(count.item()), 1) - len(units))

    # -- forward -----------------------------------------------------------------------------
    def _pack(self, mb: MicroBatch, length: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """input ids [1, length], position ids [1, length] and the PackedSeqParams of one
        micro-batch: its samples, then one padding sequence up to `length` (never read). Every
        pass of a schedule call has the same length (the pipeline's sends have fixed shapes)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        seqs = [list(t) for t in mb.tokens]
        pad = length - sum(map(len, seqs))
        if pad:
            seqs.append([0] * pad)
        lengths = [len(s) for s in seqs]
        ids = torch.tensor([[t for s in seqs for t in s]], dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(self.device)
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                              device=self.device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        return ids, pos, params

    def _length(self, units: list[MicroBatch]) -> int:
        """The packed length of every pass of a schedule call: the longest unit over all ranks,
        rounded up to a multiple of TP under sequence parallelism."""
        longest = torch.tensor([max([sum(map(len, u.tokens)) for u in units] + [1])],
                               dtype=torch.long, device=self.device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        multiple = self.options.tensor_model_parallel_size if self.options.sequence_parallel else 1
        return math.ceil(int(longest.item()) / multiple) * multiple

    def _outputs(self, logits: torch.Tensor, mb: MicroBatch, *, temperature: float,
                 with_entropy: bool, top_k: int) -> ForwardOutput:
        """Logits [1, T, V / TP] of a packed micro-batch -> per-sample outputs (full vocab)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        full = gather_from_tensor_model_parallel_region(logits)[0, :, :self.vocab_size]
        rows, targets, offset = [], [], 0
        for tokens, start in zip(mb.tokens, mb.response_starts):
            rows.append(full[offset + start - 1:offset + len(tokens) - 1])
            targets.append(torch.tensor(tokens[start:], dtype=torch.long, device=full.device))
            offset += len(tokens)
        return response_outputs(rows, targets, temperature=temperature,
                                with_entropy=with_entropy, top_k=top_k)

    def _run(self, units: list[MicroBatch], *, forward_only: bool,
             on_output: Callable[[MicroBatch, torch.Tensor], torch.Tensor]) -> None:
        """One megatron schedule call over `units`; `on_output(unit, logits)` runs on the last
        pipeline stage and returns the unit's loss (a zero tied to the graph when forward_only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        queue = iter(units)
        length = self._length(units)

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable]:
            unit = next(data_iterator)
            ids, pos, params = self._pack(unit, length)
            output = model(ids, pos, None, packed_seq_params=params)

            def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                loss = on_output(unit, logits)
                return loss, torch.ones((), dtype=torch.int, device=loss.device), {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=queue, model=[self.model],
            num_microbatches=len(units), seq_length=length, micro_batch_size=1,
            forward_only=forward_only)

    def _broadcast_from_last_stage(self, obj: Any) -> Any:
        if self.ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=self.ps.get_pipeline_model_parallel_last_rank(),
                                   group=self.ps.get_pipeline_model_parallel_group())
        return holder[0]

    @torch.no_grad()
    def forward_logprobs(self, batch: MicroBatch, *, temperature: float,
                         with_entropy: bool = False, top_k: int = 0) -> ForwardOutput:
        self.model.eval()
        units = [u for u in (batch.split() if self.options.deterministic else [batch])
                 if not u.empty]
        results: list[ForwardOutput] = []

        def collect(unit: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            if not unit.empty:
                out = self._outputs(logits, unit, temperature=temperature,
                                    with_entropy=with_entropy, top_k=top_k)
                results.append(ForwardOutput(
                    logprobs=[t.cpu() for t in out.logprobs],
                    entropy=None if out.entropy is None else [t.cpu() for t in out.entropy],
                    topk_logprobs=None if not top_k else [t.cpu() for t in out.topk_logprobs],
                    topk_ids=None if not top_k else [t.cpu() for t in out.topk_ids]))
            return logits.float().sum() * 0.0

        self._run(self._lockstep(units), forward_only=True, on_output=collect)
        results = self._broadcast_from_last_stage(results)
        merged = ForwardOutput(logprobs=[], entropy=[] if with_entropy else None,
                               topk_logprobs=[] if top_k else None, topk_ids=[] if top_k else None)
        for out in results:
            merged.logprobs += out.logprobs
            if with_entropy:
                merged.entropy += out.entropy
            if top_k:
                merged.topk_logprobs += out.topk_logprobs
                merged.topk_ids += out.topk_ids
        return merged

    # -- training ----------------------------------------------------------------------------
    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn, *, temperature: float,
                   with_entropy: bool = False) -> dict[str, float]:
        assert self.optimizer is not None, "train_step on a frozen (reference) backend"
        self.model.train()
        lr = lr_of(self.options, self.optimizer_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        units = [u for mb in micro_batches
                 for u in (mb.split() if self.options.deterministic and not mb.empty else [mb])
                 if not u.empty]
        sums: dict[str, float] = {}

        def loss_of(unit: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            anchor = logits.float().sum() * 0.0
            if unit.empty:
                return anchor
            out = self._outputs(logits, unit, temperature=temperature,
                                with_entropy=with_entropy, top_k=0)
            loss, metrics = loss_fn(out, unit)
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value.detach())
            return loss + anchor

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(self._lockstep(units), forward_only=False, on_output=loss_of)
        _, grad_norm, _ = self.optimizer.step()
        self.optimizer_steps += 1
        total: dict[str, float] = {}
        for part in self.all_gather_object(sums if self._is_output_rank() else {}):
            for name, value in part.items():
                total[name] = total.get(name, 0.0) + value
        total["train/grad_norm"] = float(grad_norm)
        total["train/lr"] = lr
        return total

    # -- state -------------------------------------------------------------------------------
    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        return megatron_state.export_hf(self.module, self.hf_config)

    def save(self, ckpt_dir: Path, *, trainer_state: dict[str, Any],
             data_tensors: dict[str, torch.Tensor], config_toml: str) -> None:
        megatron_state.save_checkpoint(self, Path(ckpt_dir), trainer_state=trainer_state,
                                       data_tensors=data_tensors, config_toml=config_toml)

    def load(self, ckpt_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return megatron_state.load_checkpoint(self, Path(ckpt_dir))
