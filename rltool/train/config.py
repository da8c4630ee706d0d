"""`TrainConfig`: the strict config of the train stage (flags, `[train]` table of a loop config),
and `BackendConfig`, the part of it a trainer backend reads."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rltool.config import ComputeDtype, cli
from rltool.delta.config import SyncConfig
from rltool.errors import ConfigError
from rltool.train.megatron_config import MegatronOptions

# The linears of attention and MLP in transformers' decoder layers (PEFT's names).
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj")


class BackendConfig(MegatronOptions):
    """What a trainer backend needs: optimizer, LR schedule, precision, device and layout (the
    megatron knobs come from MegatronOptions). The train stage's config extends it, so a backend
    takes the TrainConfig itself (or a BackendConfig for a frozen model) and no second list of
    these knobs exists."""

    # optimisation
    lr: float = Field(1e-6, gt=0.0, description="Peak learning rate (AdamW).")
    min_lr: float = Field(0.0, ge=0.0, description="Final learning rate of the cosine decay.")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    lr_decay_style: Literal["constant", "cosine"] = Field("constant", description="LR after "
                                                          "warmup.")
    lr_decay_steps: int | None = Field(None, ge=1, description="Cosine decay length in optimizer "
                                       "steps over the whole trainer lineage (needed by cosine).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    clip_grad: float = Field(1.0, ge=0.0, description="Max global gradient norm (0 = no clipping).")
    # execution
    dtype: ComputeDtype = Field("fp32", description="fp32, or bf16 compute with fp32 "
                                           "master weights.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available; "
                                                   "cpu: match an engine that runs on the CPU.")
    parallel: Literal["ddp", "fsdp"] = Field("ddp", description="Data parallelism under torchrun: "
                                             "DDP or FSDP2 (fully_shard).")
    micro_batch_layout: Literal["auto", "padded", "packed", "shared_prompt"] = Field(
        "auto", description="padded: samples right-padded to the longest; packed: concatenated "
        "without padding, attention kept inside each sample (one process); shared_prompt: each "
        "prompt once per micro-batch, followed by the responses of its samples (padded where no "
        "prompt repeats); auto: packed on CUDA in one process, shared_prompt on the CPU (padded "
        "for --loss sft), unless --deterministic, else padded.")
    logprob_chunk_tokens: int = Field(4096, ge=1, description="Packed layout: rows of logits "
                                      "computed at a time for logprobs and entropy (bounds the "
                                      "[tokens, vocab] float32 buffer).")
    recompute: Literal["none", "selective", "full", "auto"] = Field(
        "none", description="Activation recomputation (less memory, more compute). full: every "
        "decoder layer is checkpointed (~1/3 more compute); selective (megatron only): the core "
        "attention; none: off; auto: the least that the memory plan fits on the device "
        "(rltool.train.memfit; none where no device is known).")
    param_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="torch backend: dtype of the module's parameters. bf16 (with --dtype "
        "bf16): bf16 parameters and compute without autocast; their gradients accumulate in "
        "fp32 main gradients and the optimizer steps fp32 master weights it holds (one "
        "process).")
    optimizer_cpu_offload: bool = Field(
        False, description="Optimizer state and step in host memory. megatron: megatron-core's "
        "HybridDeviceOptimizer (needs --use-distributed-optimizer; Adam, as always here; "
        "--optimizer-offload-fraction of the state); torch: AdamW's moments and the fp32 "
        "parameters it steps on the host, gradients copied there, parameters copied back "
        "(one process).")
    device_memory_gb: float | None = Field(
        None, gt=0.0, description="Device memory the plan fits into, in GB (default: the CUDA "
        "device's; on the CPU nothing is checked unless given).")
    deterministic: bool = Field(False, description="One unpadded forward per sample "
                                "(rltool.logprobs.sequence_logprobs layout): exact alignment "
                                "with the engine's deterministic mode, slower.")
    seed: int = Field(0, description="Seed of torch RNG and shuffling.")
    use_rollout_routing_replay: bool = Field(
        False, description="MoE models (R3): the old-logprob recompute and training route every "
        "token to the experts the engine routed it to (the shards' rollout_routed_experts, "
        "rltool rollout --use-rollout-routing-replay) instead of the router's own top-k; the "
        "routing weights still come from the trainer's router over those experts.")
    int4_qat: bool = Field(
        False, description="INT4 quantization-aware training (torch backend): every forward "
        "fake-quantizes the weights `rltool convert int4` quantizes by default for this model "
        "(quantize then dequantize with its rounding, in the compute dtype) with a "
        "straight-through gradient; the optimizer, checkpoints and published versions keep the "
        "unquantized weights (docs/train.md, \"INT4 QAT\").")
    # 32: rltool.convert.int4.DEFAULT_GROUP_SIZE (not imported: it would load numpy into --help)
    int4_qat_group_size: int = Field(32, ge=1, description="--int4-qat: input columns per scale "
                                     "(`rltool convert int4`'s default).")
    int4_qat_symmetric: bool = Field(True, description="--int4-qat: symmetric groups, no zero "
                                     "point (`convert int4 --symmetric`); off: min-max groups "
                                     "with a zero point (`--asymmetric`).")
    # LoRA (docs/train.md, "LoRA"; the adapter layout in docs/formats.md)
    lora_rank: int = Field(0, ge=0, description="LoRA rank r: train low-rank adapters on the "
                           "frozen base (0: LoRA off, full fine-tuning).")
    lora_alpha: float | None = Field(None, gt=0.0, description="LoRA alpha: the adapter's update "
                                     "is scaled by alpha / rank (default: 2 x --lora-rank).")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' "
                                "input in training (PEFT's lora_dropout).")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_DEFAULT_TARGETS), description="Module names (the last "
        "component, e.g. q_proj) that get adapters, or all-linear: every linear layer but "
        "lm_head.", json_schema_extra=cli(metavar="NAME[,NAME...]"))
    lora_merge_on_publish: bool = Field(False, description="Publish merged full HF weights (W + "
                                        "alpha / rank x B @ A) instead of the PEFT adapter.")

    # Keys of earlier versions, each with its one-line refusal naming what replaced it: refused
    # by name in a file, --set and on the command line (rltool.commands.options adds the flags),
    # so an old config fails with the fix instead of "unknown key".
    retired_keys: ClassVar[dict[str, str]] = {
        "recompute_activations": "--recompute-activations (recompute_activations) was replaced "
                                 "by --recompute full|none ([train] recompute = \"full\")",
        "recompute_granularity": "--recompute-granularity (recompute_granularity) was replaced "
                                 "by --recompute none|selective|full ([train] recompute)"}

    @model_validator(mode="before")
    @classmethod
    def _refuse_retired(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, message in cls.retired_keys.items():
                if old in data:
                    raise ConfigError(message)
        return data

    @model_validator(mode="after")
    def _check_recompute(self) -> "BackendConfig":
        if self.backend == "torch" and self.recompute == "selective":
            raise ConfigError("--recompute selective: the torch backend recomputes whole layers; "
                              "use --recompute full, none or auto (or --backend megatron)")
        if self.param_dtype == "bf16" and self.backend == "megatron":
            raise ConfigError("--param-dtype is the torch backend's: megatron holds bf16 "
                              "parameters and fp32 masters under --dtype bf16; drop --param-dtype")
        if self.param_dtype == "bf16" and self.dtype != "bf16":
            raise ConfigError("--param-dtype bf16 computes in bf16: add --dtype bf16")
        if self.int4_qat and self.backend == "megatron":
            raise ConfigError("--int4-qat runs on the torch backend only; use --backend torch or "
                              "drop --int4-qat")
        self._check_lora()
        if (self.optimizer_cpu_offload and self.backend == "megatron"
                and not self.use_distributed_optimizer):
            raise ConfigError("--optimizer-cpu-offload needs megatron's distributed optimizer: "
                              "add --use-distributed-optimizer")
        return self

    def _check_lora(self) -> None:
        if not self.lora_rank:
            given = [f"--{name.replace('_', '-')}" for name in
                     ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_merge_on_publish")
                     if getattr(self, name) != type(self).model_fields[name].get_default(
                         call_default_factory=True)]
            if given:
                raise ConfigError(f"{given[0]} configures LoRA: add --lora-rank R (>= 1) or drop "
                                  "it")
            return
        if not self.lora_target_modules:
            raise ConfigError("--lora-target-modules is empty: name modules (q_proj,v_proj,...) "
                              "or pass all-linear")
        if "all-linear" in self.lora_target_modules and len(self.lora_target_modules) > 1:
            raise ConfigError("--lora-target-modules all-linear already takes every linear: "
                              "drop the other names")

    @property
    def lora_alpha_value(self) -> float:
        """--lora-alpha, or its default 2 x --lora-rank."""
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def lora_scale(self) -> float:
        """The adapter's multiplier alpha / rank (no rsLoRA)."""
        return self.lora_alpha_value / self.lora_rank

    @property
    def master_weights(self) -> bool:
        """The torch backend's optimizer holds fp32 master weights apart from the parameters
        (rltool.train.master_weights): bf16 parameters or a host optimizer."""
        return self.backend == "torch" and (self.param_dtype == "bf16"
                                            or self.optimizer_cpu_offload)


class TrainConfig(BackendConfig, SyncConfig):
    """The train stage's keys; the backend's (--lr, --dtype, ...) come from BackendConfig, the
    weight-sync keys (--sync, --full-every, ...) from SyncConfig and apply to --publish."""

    # inputs and outputs
    rollouts: list[str] = Field(default_factory=list,
                                description="Rollout shard directories to train on.",
                                json_schema_extra=cli(metavar="DIR[,DIR...]"))
    prompts: str | None = Field(None, description="Prompts JSONL (prompt, label) for --loss sft "
                                "without shards: the target is the label followed by EOS.")
    load: str = Field(description="HF weights directory or trainer checkpoint (step-NNNNNN) to "
                      "start from.")
    save: str | None = Field(None, description="Directory in which trainer checkpoints "
                             "step-NNNNNN are saved (RUN/train/ckpt).")
    publish: str | None = Field(None, description="Directory in which the new policy is published "
                                "as weight_vNNNNNN (RUN/weights).")
    ref: str | None = Field(None, description="Reference model weights for the KL terms.")
    old_actor: str | None = Field(None, description="Weights of the policy that generated the "
                                  "rollouts, when older than --load (off-policy rollouts): the "
                                  "old logprobs (the PPO anchor) are recomputed with them instead "
                                  "of the current weights (slime's --keep-old-actor).")
    metrics: str | None = Field(None, description="train.jsonl path (default: RUN/metrics/ when "
                                "--save is RUN/train/ckpt, else next to --save).")
    # algorithm
    loss: Literal["policy", "sft"] = Field("policy", description="policy: clipped policy "
                                           "gradient; sft: cross-entropy on loss-masked tokens.")
    advantage_estimator: Literal["grpo", "gspo", "reinforce_plus_plus",
                                 "reinforce_plus_plus_baseline", "ppo", "none",
                                 "turn_grpo"] = Field(
        "grpo", description="Advantage estimator; gspo also switches to the sequence-level "
        "ratio; ppo is GAE with a value head trained alongside the policy; none: A = 0 (pure "
        "on-policy distillation); turn_grpo: agentic episodes, each turn's return against the "
        "group's same turn (docs/agentic.md).")
    grpo_std_normalization: bool = Field(True, description="Divide GRPO advantages by the group "
                                         "std (off = Dr.GRPO).")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount of reinforce_plus_plus and "
                         "ppo (GAE) returns.")
    lambd: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda (ppo).")
    value_clip: float = Field(0.2, gt=0.0, description="PPO value clip: how far a value may move "
                              "from its old prediction before the clipped loss takes over.")
    value_loss_coef: float = Field(1.0, ge=0.0, description="Weight of the value loss (ppo).")
    eps_clip: float = Field(0.2, gt=0.0, description="PPO clip range (low side; high too unless "
                            "--eps-clip-high).")
    eps_clip_high: float | None = Field(None, gt=0.0, description="PPO clip range, high side.")
    eps_clip_c: float | None = Field(None, gt=1.0, description="Dual-clip constant c (> 1); off "
                                     "when unset.")
    kl_coef: float = Field(0.0, ge=0.0, description="KL reward shaping coefficient "
                           "(reinforce_plus_plus*, ppo), needs --ref.")
    kl_loss_coef: float = Field(0.0, ge=0.0, description="KL loss term coefficient, needs --ref.")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "low_var_kl", description="KL estimator for the loss term and for reward shaping.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient.")
    loss_aggregation: Literal["token", "sequence", "group"] = Field(
        "token", description="How per-token losses become one scalar (see docs/train.md).")
    # on-policy distillation (docs/train.md, "On-policy distillation")
    opd_type: Literal["off", "engine", "inprocess"] | None = Field(
        None, description="Teacher logprobs for on-policy distillation: engine: the shards' "
        "teacher_logprobs (rollout --opd-teacher URL); inprocess: computed here from "
        "--opd-teacher weights (the default when --opd-teacher is given, else off).")
    opd_teacher: list[str] = Field(default_factory=list, description="In-process teachers: "
                                   "[NAME=]WEIGHTS_DIR[@WEIGHT] each.",
                                   json_schema_extra=cli(metavar="SPEC[,SPEC...]"))
    opd_teacher_route: str | None = Field(None, description="Metadata field whose value names "
                                          "each sample's teacher (default: teachers mixed by "
                                          "their weights).")
    opd_kl_coef: float = Field(1.0, ge=0.0, description="beta: weight of the reverse KL to the "
                               "teacher (advantage penalty, or loss term for topk/full).")
    opd_mode: Literal["sampled", "topk", "full"] = Field(
        "sampled", description="sampled: log pi_s - log pi_T of the sampled token in the "
        "advantage; topk: KL over the student's top-k tokens; full: exact KL over the "
        "vocabulary (topk/full in-process only).")
    opd_topk: int = Field(16, ge=1, description="k of --opd-mode topk.")
    # train/rollout mismatch correction (docs/train-mismatch.md)
    tis_mode: Literal["none", "truncate", "clip", "icepop"] = Field(
        "none", description="Importance weight pi_old/pi_rollout on the policy loss (decoupled "
        "PPO): truncate, clip, or icepop (zero outside the band).")
    tis_level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="Level of the TIS ratio (icepop is token level).")
    tis_clip_low: float = Field(0.0, ge=0.0, description="Lower TIS clip / ICEPOP band bound.")
    tis_clip_high: float = Field(2.0, gt=0.0, description="Upper TIS clip / ICEPOP band bound.")
    rs_level: Literal["none", "token", "sequence", "geometric"] = Field(
        "none", description="Rejection sampling: drop tokens/samples whose ratio leaves the band.")
    rs_low: float | None = Field(None, ge=0.0, description="Rejection band low (default 1/high).")
    rs_high: float = Field(2.0, gt=0.0, description="Rejection band high.")
    rs_veto_threshold: float | None = Field(None, gt=0.0, description="Drop a sample with any "
                                            "token ratio below this.")
    bypass: bool = Field(False, description="Use the rollout logprobs as old logprobs (no "
                         "recompute; slime's --use-rollout-logprobs).")
    # schedule
    global_batch_size: int | None = Field(None, ge=1, description="Samples per optimizer step "
                                          "(default: all samples, one step per epoch).")
    num_epochs: int = Field(1, ge=1, description="Passes over the rollouts.")
    num_steps: int | None = Field(None, ge=1, description="Optimizer steps on these rollouts "
                                  "(overrides --num-epochs).")
    shuffle: bool = Field(False, description="Shuffle samples each epoch (seeded).")
    max_tokens_per_microbatch: int = Field(4096, ge=0, description="Token cap of one micro-batch "
                                           "(a longer sample is a micro-batch of its own); 0: "
                                           "the largest the memory plan fits on the device "
                                           "(rltool.train.memfit; 4096 where none is known).")
    backuper_host_budget_gb: float | None = Field(
        None, ge=0.0, description="Host memory for weight snapshots (actor, --ref, --old-actor) "
        "in GB; the least recently used spill to --backuper-dir (default: no limit).")
    backuper_dir: str | None = Field(None, description="Local SSD directory for spilled weight "
                                     "snapshots (default: a private temporary directory).")
    save_interval: int | None = Field(None, ge=1, description="Also save a checkpoint every N "
                                      "optimizer steps (one is always saved at the end).")

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.loss == "policy" and not self.rollouts:
            raise ConfigError("--rollouts: the policy loss needs rollout shards; pass "
                              "--rollouts DIR[,DIR...]")
        if self.loss == "sft" and not self.rollouts and not self.prompts:
            raise ConfigError("--loss sft needs --prompts FILE or --rollouts DIR")
        if self.prompts and self.rollouts:
            raise ConfigError("--prompts and --rollouts are exclusive; pass one of them")
        if self.prompts and self.loss != "sft":
            raise ConfigError("--prompts is only for --loss sft")
        if self.lora_rank and self.ref is not None:
            raise ConfigError("--ref with --lora-rank: the reference under LoRA is the base model "
                              "with the adapters off (no second copy); drop --ref")
        if ((self.kl_coef or self.kl_loss_coef) and self.ref is None and self.loss == "policy"
                and not self.lora_rank):
            raise ConfigError("--kl-coef/--kl-loss-coef need a reference model; pass --ref WEIGHTS")
        if self.kl_coef and self.advantage_estimator in ("grpo", "gspo", "turn_grpo"):
            raise ConfigError("--kl-coef (KL reward shaping) applies to reinforce_plus_plus* and "
                              "ppo; use --kl-loss-coef with grpo/gspo")
        if self.bypass and (self.tis_mode != "none" or self.rs_level != "none"):
            raise ConfigError("--bypass uses the rollout logprobs as old logprobs, so there is no "
                              "pi_old/pi_rollout ratio to correct: drop --tis-mode/--rs-level or "
                              "--bypass")
        if self.old_actor and (self.bypass or self.loss != "policy"):
            raise ConfigError("--old-actor recomputes the old logprobs of the policy loss; drop "
                              "it, or drop --bypass / --loss sft")
        if self.backend == "torch":
            used = self.megatron_options_set()
            if used:
                raise ConfigError(f"{used[0]} is a megatron option; add --backend megatron or "
                                  "drop it")
        elif self.value_head or self.ref or self.old_actor:
            raise ConfigError("--backend megatron does not support ppo's value head, --ref or "
                              "--old-actor yet; use --backend torch for them")
        self._check_opd()
        if self.lora_rank and not self.lora_merge_on_publish and self.precision in ("fp8",
                                                                                     "int4"):
            raise ConfigError(f"--precision {self.precision} quantizes full weights, a LoRA "
                              "version is its adapter: add --lora-merge-on-publish or drop "
                              "--precision")
        if self.lora_rank and (self.old_actor or self.opd_type == "inprocess"):
            raise ConfigError("--old-actor and in-process --opd-teacher switch full weights into "
                              "the model, which LoRA does not train: drop them or --lora-rank")
        if self.int4_qat and self.precision == "int4" and (self.int4_qat_group_size != 32
                                                           or not self.int4_qat_symmetric):
            raise ConfigError("--int4-qat-group-size/--no-int4-qat-symmetric differ from what "
                              "--precision int4 publishes (groups of 32, symmetric): drop them "
                              "or publish in another precision")
        if self.lr_decay_style == "cosine" and self.lr_decay_steps is None:
            raise ConfigError("--lr-decay-style cosine needs --lr-decay-steps N (optimizer steps "
                              "over the whole run, not just this call)")
        return self

    def _check_opd(self) -> None:
        from rltool.data.teachers import parse_teacher_specs

        teachers = parse_teacher_specs(self.opd_teacher)
        if self.opd_type is None:
            self.opd_type = "inprocess" if teachers else "off"
        if self.opd_type == "off":
            if teachers or self.opd_teacher_route or self.opd_mode != "sampled":
                raise ConfigError("--opd-teacher/--opd-teacher-route/--opd-mode need --opd-type "
                                  "engine or inprocess")
            if self.advantage_estimator == "none" and self.loss == "policy":
                raise ConfigError("--advantage-estimator none leaves no signal without on-policy "
                                  "distillation; add --opd-type engine|inprocess or pick an "
                                  "estimator")
            return
        if self.loss != "policy":
            raise ConfigError("--opd-type applies to the policy loss; drop it with --loss sft")
        if self.opd_type == "engine" and (teachers or self.opd_mode != "sampled"):
            raise ConfigError("--opd-type engine reads the shards' teacher_logprobs (the sampled-"
                              "token form): give --opd-teacher URL to rollout, not train, and "
                              "use --opd-type inprocess for --opd-mode topk/full")
        if self.backend == "megatron" and (self.opd_type == "inprocess"
                                           or self.opd_mode != "sampled"):
            raise ConfigError("--backend megatron takes engine-mode distillation (sampled) only; "
                              "use --backend torch for in-process teachers and topk/full")
        if self.opd_type == "inprocess" and not teachers:
            raise ConfigError("--opd-type inprocess needs --opd-teacher [NAME=]WEIGHTS_DIR")
        if self.opd_mode != "sampled":
            # topk/full need every response position's logits [L, V] as a tensor; the packed
            # layout reduces them chunk by chunk inside the forward.
            if self.micro_batch_layout == "packed":
                raise ConfigError("--opd-mode topk/full needs the full logits of every response "
                                  "position: use --micro-batch-layout padded (or auto)")
            if self.micro_batch_layout == "auto":  # (assignment re-runs this validator)
                self.micro_batch_layout = "padded"
        if self.opd_teacher_route and self.opd_type == "engine":
            raise ConfigError("--opd-teacher-route routes the rollout's teacher engines in engine "
                              "mode; set it on rollout")

    @property
    def value_head(self) -> bool:
        return self.loss == "policy" and self.advantage_estimator == "ppo"

    @property
    def needs_ref(self) -> bool:
        """The KL terms need reference logprobs: --ref's weights, or the base without its
        adapters under LoRA."""
        return self.loss == "policy" and bool(self.kl_coef or self.kl_loss_coef)
