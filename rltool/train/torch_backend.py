"""The `torch` trainer backend: a transformers causal LM trained with plain PyTorch.

- One process, or several under torchrun with DDP or FSDP2 (`fully_shard` per decoder layer, then
  the root); gloo on CPU, NCCL on GPUs.
- fp32, or bf16 compute with fp32 master weights: under FSDP2 through MixedPrecisionPolicy
  (bf16 params for compute, fp32 sharded masters and gradient reduction); otherwise the parameters
  stay fp32 and the forward runs under bf16 autocast (torch AMP).
- AdamW, global-norm gradient clipping, the LR schedule of rltool.train.lr.
- Logprobs under rltool.logprobs' convention. A micro-batch of several samples runs right-padded
  (no attention mask: causal attention never reaches the padding after a token), or packed into one row without padding (rltool.train.packed; logits
  in chunks, never the whole [tokens, vocab] at once); with `deterministic`, every sample runs
  alone, unpadded, exactly as rltool.logprobs.sequence_logprobs (bit-equal to the engine's
  deterministic mode in fp32). On CUDA, deterministic mode also runs every forward and backward
  through the batch-invariant kernels (rltool.batch_invariant), the engine's deterministic
  kernels; a frozen model (logprob recompute, the align gate) in bf16 then holds bf16 weights and
  runs without autocast, the engine's bf16 layout, so both sides compute the same bits.
- On CUDA: fused AdamW (one process or DDP); optional activation checkpointing. With
  `--param-dtype bf16` or `--optimizer-cpu-offload` (one process) AdamW steps fp32 masters of
  its own, on the host with the offload (rltool.train.master_weights).
- Every rank runs the same number of forward passes and backward passes: empty or missing units
  become a one-token dummy pass whose loss is multiplied by zero.
- `use_rollout_routing_replay` (MoE): a unit whose micro-batch carries routed experts replays
  them through hooks on the model's routers (rltool.train.routing_replay), in its forward and
  its backward.
- `--lora-rank` (rltool.train.lora): adapters on the frozen base; only they get gradients,
  optimizer state and checkpoints; `export_hf_state_dict` gives the merged weights and
  `export_adapter` the adapter; `adapters_off()` runs the base (the KL reference).
- Checkpoints (`save`, `load`) and adapter loading: rltool.train.torch_state.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rltool.errors import CheckpointError, ConfigError
from rltool.train import int4_qat, lora, packed, shared_prompt, torch_state
from rltool.train.backend import ForwardOutput, LossFn, MicroBatch, response_outputs
from rltool.train.config import BackendConfig, TrainConfig
from rltool.train.launch import init_distributed
from rltool.train.lr import lr_of
from rltool.train.master_weights import MasterWeights
from rltool.train.routing_replay import HFRouterReplay
from rltool.train.torch_state import VALUE_HEAD

log = logging.getLogger(__name__)


SHARED_LAYOUT_BYTES = 64 << 20  # shared-prompt layouts kept for reuse (the demo's: 30 KB each)


class TorchBackend:
    """See the module docstring; implements rltool.train.backend.TrainerBackend."""

    def __init__(self, model_dir: str | os.PathLike, *, options: BackendConfig,
                 trainable: bool = True, value_head: bool = False):
        """options: the backend's knobs (a TrainConfig is one); trainable=False: a frozen model
        (reference, logprob recompute), no optimizer; value_head: a scalar head on the last
        hidden state (PPO's critic)."""
        from safetensors import SafetensorError
        from transformers import AutoModelForCausalLM

        self.options = options
        self.trainable, self.value_head = trainable, trainable and value_head
        self.model_dir = Path(model_dir)
        self.dp_rank, self.dp_size, self.device = init_distributed(options.device)
        self.optimizer_steps = 0
        if self.trainable:  # a frozen reference must not reset the policy's RNG stream
            torch.manual_seed(options.seed + self.dp_rank)
        self.layout = self._layout(options)
        # the latest micro-batches' shared-prompt layouts, by their tokens (see _shared_layout)
        self._shared: dict[tuple[Any, ...], shared_prompt.SharedPromptBatch | None] = {}
        load_kwargs = {"attn_implementation": packed.register()} if self.packed else {}
        self.invariant = options.deterministic and self.device.type == "cuda"
        self.pure_bf16 = self.invariant and not trainable and options.dtype == "bf16"
        try:
            inner = AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.bfloat16 if self.pure_bf16 else torch.float32,
                **load_kwargs)
        except (OSError, ValueError, SafetensorError) as e:  # SafetensorError: a corrupt file
            raise CheckpointError(f"{model_dir}: cannot load the model ({e}); pass a complete "
                                  "HF weights directory") from e
        self.config, self.vocab_size = inner.config, int(inner.config.vocab_size)
        self.qat = int4_qat.for_backend(inner, options)  # before the value head: never published
        # After QAT (whose targets are the base's weights), before the value head (trained whole)
        self.lora = lora.for_backend(inner, options) if trainable else None
        if self.value_head:
            # Zero init: values start at 0, so the first advantages are plain discounted rewards.
            inner.add_module(VALUE_HEAD, torch.nn.Linear(self.config.hidden_size, 1))
            torch.nn.init.zeros_(inner.value_head.weight)
            torch.nn.init.zeros_(inner.value_head.bias)
        self.inner = inner.to(self.device)
        self.replay = HFRouterReplay(inner) if options.use_rollout_routing_replay else None
        self.fsdp = options.parallel == "fsdp" and self.dp_size > 1
        self.ddp = options.parallel == "ddp" and self.dp_size > 1 and self.trainable
        self.model: Any = self.inner
        if self.fsdp:
            self._shard()
        elif self.ddp:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(
                self.inner, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.optimizer = None
        # CPU: AdamW and the clip as one op per kind over all tensors (the per-tensor loops' bits)
        self.foreach = True if self.device.type == "cpu" and not self.fsdp else None
        if self.trainable:
            if options.recompute == "full":  # "selective" is refused by BackendConfig
                enable = getattr(self.inner, "activation_checkpointing_enable", None) or \
                    self.inner.gradient_checkpointing_enable  # the older transformers name
                enable({"use_reentrant": False})
            adamw = functools.partial(
                torch.optim.AdamW, lr=options.lr, betas=(options.adam_beta1, options.adam_beta2),
                eps=options.adam_eps, weight_decay=options.weight_decay,
                fused=self.device.type == "cuda" and not self.fsdp)
            param_dtype = torch.bfloat16 if options.param_dtype == "bf16" else torch.float32
            if self.lora is not None:  # the frozen base in the parameters' dtype, no master
                for p in self.inner.parameters():
                    if not p.requires_grad:
                        p.data = p.data.to(param_dtype)
            trained = [(n, p) for n, p in self.inner.named_parameters() if p.requires_grad]
            self.optimizer = adamw([p for _, p in trained]) if not self.masters else \
                MasterWeights(trained, adamw, param_dtype=param_dtype,
                              host=options.optimizer_cpu_offload, processes=self.dp_size)
        else:
            self.inner.requires_grad_(False)

    # -- setup -------------------------------------------------------------------------------
    def _layout(self, options: BackendConfig) -> str:
        """padded, packed or shared_prompt. auto: packed on one GPU; on the CPU shared_prompt
        for policy losses (groups repeat every prompt), padded for SFT (prompts repeat only by
        chance), when deterministic and for hybrids (rltool.train.packed.hybrid_layout)."""
        layout = options.micro_batch_layout
        if layout == "packed" and options.deterministic:
            raise ConfigError("--micro-batch-layout packed and --deterministic exclude each "
                              "other (deterministic runs every sample alone); drop one")
        if layout == "packed" and self.dp_size > 1:
            raise ConfigError("--micro-batch-layout packed runs in one process; use padded "
                              "(or auto) under torchrun")
        if layout == "shared_prompt" and options.deterministic:
            raise ConfigError("--micro-batch-layout shared_prompt and --deterministic exclude "
                              "each other (deterministic runs every sample alone); drop one")
        if hybrid := packed.hybrid_layout(self.model_dir, layout):  # GDN: padded only
            return hybrid
        if layout != "auto":
            return layout
        if options.deterministic:
            return "padded"
        if self.device.type == "cuda":
            return "packed" if self.dp_size == 1 else "padded"
        sft = isinstance(options, TrainConfig) and options.loss == "sft"
        return "shared_prompt" if self.device.type == "cpu" and not sft else "padded"

    packed = property(lambda self: self.layout == "packed")
    masters = property(lambda self: self.trainable and self.options.master_weights)
    shared_prompts = property(lambda self: self.layout == "shared_prompt")

    def _shared_layout(self, mb: MicroBatch) -> shared_prompt.SharedPromptBatch | None:
        """The micro-batch's shared-prompt layout (None: no two samples share a prompt), built
        once for the old-logprob pass and the optimizer step that run the same micro-batch."""
        key = (tuple(map(tuple, mb.tokens)), tuple(mb.response_starts))
        if key in self._shared:
            return self._shared[key]
        built = shared_prompt.build(mb.tokens, mb.response_starts, pad=self._pad_id(),
                                    device=self.device)
        self._shared[key] = built
        while sum(map(shared_prompt.nbytes, self._shared.values())) > SHARED_LAYOUT_BYTES:
            del self._shared[next(iter(self._shared))]  # the oldest first
        return built

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.dp_size,))
        mp = MixedPrecisionPolicy()
        if self.options.dtype == "bf16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        block_types = set(getattr(self.inner, "_no_split_modules", None) or [])
        for module in self.inner.modules():
            if type(module).__name__ in block_types:
                fully_shard(module, mesh=mesh, mp_policy=mp)
        if self.value_head:  # its own unit: it runs outside the root's forward
            fully_shard(self.inner.value_head, mesh=mesh, mp_policy=mp)
        fully_shard(self.inner, mesh=mesh, mp_policy=mp)

    def _kernels(self) -> contextlib.AbstractContextManager:
        """The batch-invariant kernels in deterministic mode on CUDA, else torch's own."""
        if not self.invariant:
            return contextlib.nullcontext()
        from rltool import batch_invariant

        return batch_invariant.enabled("cuda")

    def _replaying(self, mb: MicroBatch) -> contextlib.AbstractContextManager:
        """Rollout routing replay of `mb`'s routes, in the token layout `_forward` gives it."""
        if self.replay is None or mb.empty or mb.routed_experts is None:
            return contextlib.nullcontext()
        padded = not self.packed and len(mb.tokens) > 1
        return self.replay.replaying(mb, device=self.device,
                                     width=max(map(len, mb.tokens)) if padded else None)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if (self.options.dtype == "bf16" and not self.fsdp and not self.pure_bf16
                and self.options.param_dtype == "fp32"):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- collectives -------------------------------------------------------------------------
    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.dp_size == 1:
            return [obj]
        out: list[Any] = [None] * self.dp_size
        dist.all_gather_object(out, obj)
        return out

    def _max_over_ranks(self, n: int) -> int:
        if self.dp_size == 1:
            return n
        t = torch.tensor([n], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _units(self, micro_batches: list[MicroBatch], *, lockstep: bool) -> list[MicroBatch]:
        """Forward units: the micro-batches, or one sample each when deterministic; padded with
        empty units to the same count on every rank when passes are collective."""
        units = [u for mb in micro_batches
                 for u in (mb.split() if self.options.deterministic and not mb.empty else [mb])]
        units = [u for u in units if not u.empty]
        if not lockstep:
            return units
        count = max(self._max_over_ranks(len(units)), 1)
        return units + [MicroBatch([], [], [])] * (count - len(units))

    # -- forward -----------------------------------------------------------------------------
    def _forward(self, module: Any, mb: MicroBatch, *, temperature: float, with_entropy: bool,
                 top_k: int, with_logits: bool = False) -> tuple[ForwardOutput, torch.Tensor]:
        """Run one unit; returns the outputs and a zero scalar tied to the graph (for dummies)."""
        if mb.empty:
            ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            logits, values = self._model_call(module, ids)
            anchor = logits.float().sum() * 0.0
            if values is not None:
                anchor = anchor + values.sum() * 0.0
            return ForwardOutput(logprobs=[]), anchor
        if self.packed:
            return self._packed_forward(mb, temperature=temperature, with_entropy=with_entropy,
                                        top_k=top_k)
        if self.shared_prompts and mb.routed_experts is None:  # replay: the padded layout
            shared = self._shared_layout(mb)
            if shared is not None:
                logits, values = self._model_call(module, shared.ids,
                                                  position_ids=shared.positions,
                                                  attention_mask=shared.mask)
                return self._response_rows(logits, values, shared.rows, shared.targets,
                                           shared.sizes, temperature=temperature,
                                           with_entropy=with_entropy, top_k=top_k,
                                           with_logits=with_logits)
        lengths = [len(t) for t in mb.tokens]
        width = max(lengths)
        # One sample: unpadded -- the layout of rltool.logprobs.sequence_logprobs. Several:
        # right-padded and without an attention mask, since under causal attention a token never
        # sees the padding after it: the same logits at every real position (bit for bit on CPU
        # in fp32) from SDPA's causal path, without building and applying a padding mask
        # (-15% forward, -20% forward + backward on the demo's 64 x 35 micro-batches).
        pad = self._pad_id()
        ids = torch.tensor([t + [pad] * (width - len(t)) for t in mb.tokens], dtype=torch.long,
                           device=self.device)
        logits, values = self._model_call(module, ids)
        # The rows (in the flattened [B * width] layout) whose logits predict a response token:
        # position j - 1 of a sample predicts its token j, for j from its response start.
        spans = [(i * width + start - 1, i * width + n - 1)
                 for i, (n, start) in enumerate(zip(lengths, mb.response_starts))]
        rows = torch.tensor([r for a, b in spans for r in range(a, b)], dtype=torch.long,
                            device=self.device)
        return self._response_rows(logits, values, rows, ids.view(-1).index_select(0, rows + 1),
                                   [b - a for a, b in spans], temperature=temperature,
                                   with_entropy=with_entropy, top_k=top_k,
                                   with_logits=with_logits)

    def _pad_id(self) -> int:
        return self.config.pad_token_id if self.config.pad_token_id is not None else 0

    def _response_rows(self, logits: torch.Tensor, values: torch.Tensor | None,
                       rows: torch.Tensor, targets: torch.Tensor, sizes: list[int], *,
                       temperature: float, with_entropy: bool, top_k: int,
                       with_logits: bool) -> tuple[ForwardOutput, torch.Tensor]:
        """The outputs of the logits rows (flat indices into [B * width]) that predict
        `targets`, `sizes` rows per sample."""
        flat = logits.reshape(-1, logits.shape[-1]).index_select(0, rows)
        out = response_outputs(flat, targets, sizes, temperature=temperature,
                               with_entropy=with_entropy, top_k=top_k)
        if values is not None:
            # V_t: the value of the state before response token t (same rows as its logits).
            out.extras["values"] = list(values.reshape(-1).index_select(0, rows).split(sizes))
        if with_logits:  # the response rows' raw logits [L, V] (on-policy distillation)
            out.extras["logits"] = list(flat.split(sizes))
        return out, logits.float().sum() * 0.0

    def _packed_forward(self, mb: MicroBatch, *, temperature: float, with_entropy: bool,
                        top_k: int) -> tuple[ForwardOutput, torch.Tensor]:
        p = packed.pack(mb.tokens, mb.response_starts, self.device)
        decoder = getattr(self.inner, self.inner.base_model_prefix)
        with self._autocast():
            hidden = decoder(**packed.decoder_kwargs(p)).last_hidden_state[0]
            parts = packed.response_outputs(hidden, p, self.inner.lm_head,
                                            temperature=temperature, with_entropy=with_entropy,
                                            top_k=top_k, chunk=self.options.logprob_chunk_tokens)
            out = ForwardOutput(logprobs=parts["logprobs"], entropy=parts.get("entropy"),
                                topk_logprobs=parts.get("topk_logprobs"),
                                topk_ids=parts.get("topk_ids"))
            if self.value_head:
                values = self.inner.value_head(hidden.index_select(0, p.rows)).squeeze(-1)
                out.extras["values"] = list(values.float().split(p.response_lengths))
        return out, hidden.float().sum() * 0.0

    def _model_call(self, module: Any, ids: torch.Tensor, **layout: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, values or None) for a batch of right-padded ids (causal: no mask), or of a
        shared-prompt layout (`layout`: its position ids and attention mask)."""
        with self._autocast():
            if not self.value_head:
                return module(input_ids=ids, use_cache=False, **layout).logits, None
            out = module(input_ids=ids, use_cache=False, output_hidden_states=True, **layout)
            values = self.inner.value_head(out.hidden_states[-1]).squeeze(-1)
        return out.logits, values.float()

    @torch.no_grad()
    def forward_logprobs(self, batch: MicroBatch, *, temperature: float,
                         with_entropy: bool = False, top_k: int = 0,
                         with_logits: bool = False) -> ForwardOutput:
        if self.inner.training:
            self.inner.eval()
        # DDP needs no collective without grad; FSDP all-gathers in every pass.
        module = self.model if self.fsdp else self.inner
        merged = ForwardOutput(logprobs=[], entropy=[] if with_entropy else None,
                               topk_logprobs=[] if top_k else None, topk_ids=[] if top_k else None)
        for unit in self._units([batch], lockstep=self.fsdp):
            with self._kernels(), self._replaying(unit):
                out, _ = self._forward(module, unit, temperature=temperature,
                                       with_entropy=with_entropy, top_k=top_k,
                                       with_logits=with_logits)
            merged.logprobs += out.logprobs
            for key in ("values", "logits"):
                if key in out.extras:
                    merged.extras.setdefault(key, []).extend(out.extras[key])
            if with_entropy:
                merged.entropy += out.entropy or []
            if top_k:
                merged.topk_logprobs += out.topk_logprobs or []
                merged.topk_ids += out.topk_ids or []
        return merged

    # -- training ----------------------------------------------------------------------------
    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        if self.fsdp:
            self.model.set_requires_gradient_sync(last)
        elif self.ddp and not last:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn, *, temperature: float,
                   with_entropy: bool = False, with_logits: bool = False) -> dict[str, float]:
        assert self.optimizer is not None, "train_step on a frozen (reference) backend"
        if not self.inner.training:
            self.inner.train()
        lr = lr_of(self.options, self.optimizer_steps)
        for group in self.optimizer.param_groups:  # foreach also after a checkpoint's load
            group["lr"], group["foreach"] = lr, self.foreach
        units = self._units(micro_batches, lockstep=self.dp_size > 1)
        sums: dict[str, float] = {}
        for k, unit in enumerate(units):
            with self._grad_sync(k == len(units) - 1), self._kernels(), self._replaying(unit):
                out, anchor = self._forward(self.model, unit, temperature=temperature,
                                            with_entropy=with_entropy, top_k=0,
                                            with_logits=with_logits)
                loss, metrics = (anchor, {}) if unit.empty else loss_fn(out, unit)
                # DDP and FSDP average gradients over ranks; the loss is already a global sum.
                (loss * self.dp_size).backward()
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value.detach())
        grad_norm = self._clip_grad_norm()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        total: dict[str, float] = {}
        for part in self.all_gather_object(sums):
            for name, value in part.items():
                total[name] = total.get(name, 0.0) + value
        total["train/grad_norm"] = grad_norm
        total["train/lr"] = lr
        return total

    def _clip_grad_norm(self) -> float:
        max_norm = self.options.clip_grad if self.options.clip_grad > 0 else math.inf
        if self.masters:
            return self.optimizer.clip_grad_norm(max_norm, foreach=self.foreach)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=max_norm,
                                              foreach=self.foreach)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # -- state -------------------------------------------------------------------------------
    def full_state_options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=self.dp_size > 1)

    def full_model_state(self, *, on_device: bool = False) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # One process: the module's own state dict, the same keys and tensors without the
        # distributed helper's walk over the module tree (3-6 ms per sync on the demo's model).
        state = (self.inner.state_dict() if self.dp_size == 1 else
                 get_model_state_dict(self.model, options=self.full_state_options()))
        state = self.optimizer.with_masters(state) if self.masters else state
        keep = on_device and self.dp_size == 1
        return ({k: v.detach() if keep else v.detach().cpu() for k, v in state.items()}
                if self.dp_rank == 0 else {})

    def export_hf_state_dict(self, *, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The policy's tensors under HF names, copied to host memory; `on_device` (one process):
        the parameters where they live, uncopied (a caller casting them on the device). Under
        LoRA the base with the adapters merged in (rltool.train.lora.merged)."""
        state = {k: v for k, v in self.full_model_state(on_device=on_device).items()
                 if not k.startswith(VALUE_HEAD + ".")}
        return state if self.lora is None else lora.merged(state, scale=self.lora.scale)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The parameters that train (LoRA: the adapters and the value head), full and fp32 (the
        masters with master weights) in host memory on rank 0, empty on the others: the base
        is never gathered or copied (collective under FSDP, every rank in the same order)."""
        named = [(n, p) for n, p in self.inner.named_parameters() if p.requires_grad]
        if self.masters:
            masters = self.optimizer.with_masters(dict(named))
            named = [(n, masters[n]) for n, _ in named]
        out = {}
        for name, p in named:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if self.dp_rank == 0:
                out[name] = full.detach().to("cpu", torch.float32)
        return out

    def export_adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's tensors under the model's names (`...q_proj.lora_A.weight`), on
        rank 0 (empty on the others); fp32 (the masters with master weights)."""
        assert self.lora is not None, "export_adapter without --lora-rank"
        return {k: v for k, v in self.trained_state().items() if lora.is_adapter_key(k)}

    def adapters_off(self) -> contextlib.AbstractContextManager:
        """Forwards of the base model, the LoRA adapters off (the KL reference under LoRA)."""
        assert self.lora is not None, "adapters_off without --lora-rank"
        return self.lora.disabled()

    def save(self, ckpt_dir: Path, *, trainer_state: dict[str, Any],
             data_tensors: dict[str, torch.Tensor], config_toml: str) -> None:
        torch_state.save(self, Path(ckpt_dir), trainer_state=trainer_state,
                         data_tensors=data_tensors, config_toml=config_toml)

    def load(self, ckpt_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Restore optimizer, schedule step and RNG (the weights came from ckpt_dir/model; under
        LoRA the adapter from ckpt_dir/adapter)."""
        return torch_state.load(self, Path(ckpt_dir))

    def load_adapter(self, directory: Path) -> None:
        """A PEFT adapter directory into this model's LoRA adapters (rltool.train.torch_state)."""
        torch_state.load_adapter(self, Path(directory))
