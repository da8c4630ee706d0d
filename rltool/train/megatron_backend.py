"""The `megatron` trainer backend: megatron-core's GPTModel with TP/PP/EP and packed sequences.

- The model is the one `rltool convert` builds (rltool.convert.gpt_model, local layer spec with
  rltool's SDPA core attention, or the transformer-engine spec), filled from the HF weights of
  `--load` (each rank its own shards) or from a megatron trainer checkpoint.
- Layout flags carry Megatron-LM's names (rltool.train.megatron_config); ranks come from torchrun.
  The data-parallel size is world / (TP * PP * CP); the DP schedule of rltool.train.dp_schedule
  assigns micro-batches to DP ranks exactly as for the torch backend.
- A micro-batch runs packed (THD): its samples back to back in one [1, T] row, positions restarting
  per sample, `PackedSeqParams` delimiting them (attention and RoPE never cross a boundary), built
  on the host and moved in one asynchronous copy (rltool.train.packed.pack). The last stage
  returns the decoder's hidden states; the response rows' logits come from the output layer in
  chunks, gathered over TP and cut to the real vocabulary, turned into logprobs by
  rltool.train.packed.response_outputs, the function the torch backend's packed layout uses.
- Per micro-batch the host never waits for the device (no `.item()`, `.tolist()` or blocking copy;
  metrics are summed on the device, the logprob pass's outputs reach the host in one copy per
  field after the last micro-batch), so the CPU queues kernels ahead of the GPU.
- Forward and backward run through megatron's pipeline schedules (`get_forward_backward_func`),
  one call per logprob micro-batch and one per optimizer step, with `calculate_per_token_loss`:
  the stage's losses are already normalised for the global batch, so the schedule divides by
  nothing and megatron's DDP sums gradients over DP ranks instead of averaging them.
- Optimizer: megatron's (Adam with decoupled weight decay, global-norm clipping over all model
  parallel ranks, fp32 master weights with bf16, optionally the distributed optimizer), its
  learning rate set each step from rltool.train.lr like the torch backend.
- Checkpoints and the HF export: rltool.train.megatron_state.
- `--lora-rank` (rltool.train.megatron_lora): adapters on the frozen base's tensor-parallel
  linears; only they get gradients, optimizer state and checkpoint shards;
  `export_hf_state_dict` gives the merged weights, `export_adapter` the adapter (PEFT's names,
  gathered over TP and PP), `load_adapter` reads one into every rank's shards, `adapters_off()`
  runs the base.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rltool import megatron_compat
from rltool.errors import CheckpointError, ConfigError
from rltool.train import lora, megatron_lora, megatron_offload, megatron_state, packed
from rltool.train.backend import ForwardOutput, LossFn, MicroBatch
from rltool.train.config import BackendConfig
from rltool.train.lr import lr_of
from rltool.train.megatron_routing import MegatronRouterReplay

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
        # weight gradients accumulate straight into the fp32 main_grad buffers (one GEMM each)
        gradient_accumulation_fusion=cuda and megatron_compat.enable_cuda_fusions(),
        # SwiGLU as one torch.compile'd kernel each way (megatron's own fusion)
        bias_activation_fusion=cuda,
        # HF's forward (the torch backend, the engines) adds no load-balancing loss
        moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    if options.recompute != "none":
        overrides["recompute_granularity"] = options.recompute
        if options.recompute == "full":
            overrides.update(recompute_method="uniform", recompute_num_layers=1)
    return overrides


OUTPUT_FIELDS = ("logprobs", "entropy", "topk_logprobs", "topk_ids")


def _to_host(outputs: list[ForwardOutput]) -> list[ForwardOutput]:
    """The per-sample tensors of `outputs` on the CPU with one device-to-host copy per field (a
    `.cpu()` per tensor would make the host wait for the device after every sample)."""
    hosted = [ForwardOutput(logprobs=[]) for _ in outputs]
    for name in OUTPUT_FIELDS:
        parts = [getattr(out, name) for out in outputs]
        if not parts or parts[0] is None:
            continue
        flat = [t for part in parts for t in part]
        host = iter(torch.cat(flat).cpu().split([t.shape[0] for t in flat]) if flat else [])
        for out, part in zip(hosted, parts):  # own storage each, like a per-tensor .cpu()
            setattr(out, name, [next(host).clone() for _ in part])
    return hosted


class MegatronBackend:
    """See the module docstring; implements rltool.train.backend.TrainerBackend."""

    def __init__(self, model_dir: str | os.PathLike, *, options: BackendConfig,
                 trainable: bool = True, value_head: bool = False):
        from rltool.convert.gpt_model import build_gpt_model, padded_vocab_size

        if value_head:
            raise ConfigError("--backend megatron has no value head (ppo); use --backend torch")
        if packed.has_linear_attention(model_dir):
            raise ConfigError("--backend megatron does not train linear-attention hybrids "
                              "(megatron-core 0.16.1's gated_delta_net needs "
                              "flash-linear-attention and supports neither packed sequences nor "
                              "inference); use --backend torch")
        self.options, self.trainable = options, trainable
        self.model_dir = Path(model_dir)
        cuda = torch.cuda.is_available()
        if options.device == "cuda" and not cuda:
            raise ConfigError("--device cuda but no CUDA device is visible; use --device auto or "
                              "cpu")
        if options.device == "cpu" and cuda:
            raise ConfigError("--backend megatron uses the GPUs when CUDA is visible (its process "
                              "groups are NCCL); use --device auto, or hide the GPUs")
        if trainable and not cuda and options.dtype != "fp32":
            raise ConfigError("--dtype bf16 needs CUDA to train with --backend megatron (megatron-"
                              "core's mixed-precision optimizers check for CUDA tensors); use "
                              "--dtype fp32 on the CPU")
        try:
            self.hf_config = json.loads((self.model_dir / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{model_dir}: unreadable config.json ({e})") from e
        if trainable and options.lora_rank:
            megatron_lora.check_layout(options, self.hf_config)
        megatron_compat.init_distributed(**_sizes(options), seed=options.seed)
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(
            "cpu")
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.optimizer_steps = 0
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
        for norm in model.modules():
            # megatron's torch-norm fallback builds fp32 norms; with bf16 activations torch then
            # runs the unfused norm (several kernels and casts per call). Megatron-LM's bf16
            # wrapper casts them the same way; the optimizer keeps their fp32 masters.
            if isinstance(norm, torch.nn.RMSNorm | torch.nn.LayerNorm):
                norm.to(dtype)
        if cuda:
            model = model.cuda()
        megatron_state.load_hf_weights(model, self.model_dir)
        # after the base is filled (its loader knows the plain model's tensors only)
        self.lora = megatron_lora.for_backend(model, options) if trainable else None
        self.replay = MegatronRouterReplay(
            model, options, tp_rank=ps.get_tensor_model_parallel_rank()
        ) if options.use_rollout_routing_replay else None  # rltool.train.megatron_routing
        self.config = model.config
        self.module = model
        # RoPE from tables built once per packed row (rltool.train.megatron_attention), where the
        # model's RoPE is megatron's plain, non-interleaved one
        self.row_rope = (getattr(model, "position_embedding_type", None) == "rope"
                         and not self.config.rotary_interleaved
                         and not self.config.multi_latent_attention
                         and not self.config.apply_rope_fusion)
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
            use_distributed_optimizer=o.use_distributed_optimizer,
            **megatron_offload.optimizer_config(o, cuda=self.device.type == "cuda"))
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

    def _paired(self) -> bool:
        """Whether passes pair up across ranks (the pipeline's sends, expert-parallel dispatch),
        so every rank must run the same number of passes of the same length."""
        return (self.ps.get_pipeline_model_parallel_world_size() > 1
                or self.ps.get_expert_model_parallel_world_size() > 1)

    def _lockstep(self, units: list[MicroBatch]) -> list[MicroBatch]:
        """Pad with empty units to the same count on every rank when passes pair up; otherwise
        (no collective, so no wait for the device) at least one pass, which a rank without units
        still runs for the step's gradient reduction."""
        if not self._paired():
            return units or [MicroBatch([], [], [])]
        count = torch.tensor([len(units)], dtype=torch.long, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return units + [MicroBatch([], [], [])] * (max(int(count.item()), 1) - len(units))

    # -- forward -----------------------------------------------------------------------------
    def _pack(self, mb: MicroBatch, length: int) -> tuple[packed.Packed, Any]:
        """The packed row of one micro-batch, [1, length]: its samples, then one padding sequence
        up to `length` when it is shorter (no response rows, never read), and its
        RowParams. The offsets megatron's THD rotary embedding reads per layer stay on the CPU
        (on the device each read would wait for the GPU to drain); the core attention takes the
        copy that arrived with the row."""
        from rltool.train.megatron_attention import RowParams, rotary_tables

        tokens, starts = list(mb.tokens), list(mb.response_starts)
        pad = length - sum(map(len, tokens))
        if pad:
            tokens.append([0] * pad)
            starts.append(pad)
        p = packed.pack(tokens, starts, self.device)
        rotary = None
        if self.row_rope:  # the frequencies GPTModel computes, at the row's positions
            emb = self.module.rotary_pos_emb(p.max_len, packed_seq=True, cp_group=None)
            rotary = rotary_tables(emb, p.position_ids[0], self.config.params_dtype)
        params = RowParams(qkv_format="thd", cu_seqlens_q=p.cu_seqlens_host,
                           cu_seqlens_kv=p.cu_seqlens_host, max_seqlen_q=p.max_len,
                           max_seqlen_kv=p.max_len, cu_seqlens_device=p.cu_seqlens,
                           rotary=rotary)
        return p, params

    def _rounded(self, tokens: int) -> int:
        """A packed length: at least one token, a multiple of TP under sequence parallelism."""
        multiple = self.options.tensor_model_parallel_size if self.options.sequence_parallel else 1
        return math.ceil(max(tokens, 1) / multiple) * multiple

    def _length(self, units: list[MicroBatch]) -> int | None:
        """The packed length every pass of a schedule call shares when passes pair up across
        ranks (the pipeline's sends have fixed shapes, expert dispatch gathers equal shapes): the
        longest unit over all ranks. None without PP and EP: each pass keeps its own length, so
        no compute goes to padding."""
        if not self._paired():
            return None
        longest = torch.tensor([max([sum(map(len, u.tokens)) for u in units] + [1])],
                               dtype=torch.long, device=self.device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        return self._rounded(int(longest.item()))

    def _logits_of(self) -> packed.LogitsOf:
        """Hidden rows [r, hidden] -> logits [r, vocab]: the output layer's TP shard, gathered
        over TP, cut to the real vocabulary."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        module = self.module
        weight = (module.shared_embedding_or_output_weight()
                  if module.share_embeddings_and_output_weights else module.output_layer.weight)
        vocab = self.vocab_size

        def logits_of(hidden: torch.Tensor) -> torch.Tensor:
            return gather_from_tensor_model_parallel_region(F.linear(hidden, weight))[:, :vocab]

        return logits_of

    def _outputs(self, hidden: torch.Tensor, p: packed.Packed, *, samples: int, temperature: float,
                 with_entropy: bool, top_k: int) -> ForwardOutput:
        """The last stage's hidden states [T (/ TP under sequence parallelism), 1, hidden] of a
        packed row -> per-sample outputs, through the torch backend's chunked logprobs (logits
        `logprob_chunk_tokens` rows at a time, never [T, vocab] at once)."""
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   gather_from_sequence_parallel_region)

        hidden = hidden[:, 0]
        # what the output layer does with its input: all-gather the sequence shards, or mark the
        # replicated input so its gradient is summed over TP
        hidden = (gather_from_sequence_parallel_region(hidden) if self.options.sequence_parallel
                  else copy_to_tensor_model_parallel_region(hidden))
        parts = packed.response_outputs(hidden, p, self._logits_of(), temperature=temperature,
                                        with_entropy=with_entropy, top_k=top_k,
                                        chunk=self.options.logprob_chunk_tokens)
        # the first `samples` are the micro-batch's; a padding sequence after them has no rows
        parts = {name: value[:samples] for name, value in parts.items()}
        return ForwardOutput(logprobs=parts["logprobs"], entropy=parts.get("entropy"),
                             topk_logprobs=parts.get("topk_logprobs"),
                             topk_ids=parts.get("topk_ids"))

    @contextlib.contextmanager
    def _hidden_out(self) -> Iterator[None]:
        """GPTModel returns the decoder's final (normed) hidden states instead of logits while its
        `post_process` is off; the logits are then computed chunk by chunk (`_outputs`). With
        `row_rope` its own RoPE is off too: the core attention applies the row's tables."""
        module = self.module
        last = module.post_process, module.position_embedding_type
        module.post_process = False
        if self.row_rope:
            module.position_embedding_type = "none"
        try:
            yield
        finally:
            module.post_process, module.position_embedding_type = last

    def _run(self, units: list[MicroBatch], *, forward_only: bool,
             on_output: Callable[[MicroBatch, packed.Packed, torch.Tensor], torch.Tensor]) -> None:
        """One megatron schedule call over `units`; `on_output(unit, packed_row, hidden)` runs on
        the last pipeline stage and returns the unit's loss (a zero tied to the graph when
        forward_only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        queue = iter(units)
        length = self._length(units)

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable]:
            unit = next(data_iterator)
            p, params = self._pack(unit, length or self._rounded(sum(map(len, unit.tokens))))
            if self.replay is not None:
                self.replay.prepare(unit, p.ids.shape[1], self.device)
            with self._hidden_out():
                output = model(p.ids, p.position_ids, None, packed_seq_params=params)

            def loss_func(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                loss = on_output(unit, p, hidden)
                return loss, torch.ones((), dtype=torch.int, device=loss.device), {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=queue, model=[self.model],
            num_microbatches=len(units), seq_length=length or 0, micro_batch_size=1,
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

        def collect(unit: MicroBatch, p: packed.Packed, hidden: torch.Tensor) -> torch.Tensor:
            if not unit.empty:
                results.append(self._outputs(hidden, p, samples=len(unit.tokens),
                                             temperature=temperature, with_entropy=with_entropy,
                                             top_k=top_k))
            return hidden.sum() * 0.0

        self._run(self._lockstep(units), forward_only=True, on_output=collect)
        results = self._broadcast_from_last_stage(_to_host(results))
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
        sums: dict[str, torch.Tensor] = {}

        def loss_of(unit: MicroBatch, p: packed.Packed, hidden: torch.Tensor) -> torch.Tensor:
            if unit.empty:
                return hidden.sum() * 0.0
            out = self._outputs(hidden, p, samples=len(unit.tokens), temperature=temperature,
                                with_entropy=with_entropy, top_k=0)
            loss, metrics = loss_fn(out, unit)
            for name, value in metrics.items():  # summed on the device: no sync per micro-batch
                sums[name] = sums.get(name, 0.0) + value.detach().double()
            return loss

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(self._lockstep(units), forward_only=False, on_output=loss_of)
        _, grad_norm, _ = self.optimizer.step()
        self.optimizer_steps += 1
        own = {name: float(value) for name, value in sums.items()} if self._is_output_rank() else {}
        total: dict[str, float] = {}
        for part in self.all_gather_object(own):
            for name, value in part.items():
                total[name] = total.get(name, 0.0) + value
        total["train/grad_norm"] = float(grad_norm)
        total["train/lr"] = lr
        return total

    # -- state -------------------------------------------------------------------------------
    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full HF tensors on global rank 0; under LoRA the base with the adapters
        merged in (rltool.train.lora.merged)."""
        slots = megatron_state.gather_slots(self.module)
        state = megatron_state.export_hf(self.module, self.hf_config, slots=slots)
        if self.lora is None or not state:
            return state
        return lora.merged(state | megatron_lora.adapter_tensors(slots), scale=self.lora.scale)

    def export_adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's tensors under the HF model's names
        (`model.layers.0.self_attn.q_proj.lora_A.weight`), gathered over TP, fp32, on global
        rank 0 (empty on the others). Collective."""
        assert self.lora is not None, "export_adapter without --lora-rank"
        slots = megatron_state.gather_slots(self.module, keep=megatron_lora.is_adapter_key)
        return {k: v.float() for k, v in megatron_lora.adapter_tensors(slots).items()}

    def load_adapter(self, directory: Path) -> None:
        """A PEFT adapter directory (a checkpoint's, a LoRA version, PEFT's save_pretrained)
        into this model's adapters, each rank its shards; refused unless it is exactly their
        rank, alpha, targets and tensors."""
        assert self.lora is not None, "load_adapter without --lora-rank"
        config, tensors = lora.read_adapter(Path(directory))
        self.lora.check_config(config, where=Path(directory), base_model_dir=self.model_dir)
        self.lora.load(tensors, where=Path(directory))

    def adapters_off(self) -> contextlib.AbstractContextManager:
        """Forwards of the base model, the LoRA adapters off (the KL reference under LoRA)."""
        assert self.lora is not None, "adapters_off without --lora-rank"
        return self.lora.disabled()

    def save(self, ckpt_dir: Path, *, trainer_state: dict[str, Any],
             data_tensors: dict[str, torch.Tensor], config_toml: str) -> None:
        megatron_state.save_checkpoint(self, Path(ckpt_dir), trainer_state=trainer_state,
                                       data_tensors=data_tensors, config_toml=config_toml)

    def load(self, ckpt_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return megatron_state.load_checkpoint(self, Path(ckpt_dir))
