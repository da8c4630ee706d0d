"""The GPU demo's recipes (`python -m rltool.demo --device cuda`, or `--task add|reverse`):
exact-match GRPO on the Qwen2.5-0.5B shapes (vocabulary sized to the demo's tokenizer) for a task
the tiny CPU model cannot learn: reversing 8-12 digit strings (`reverse`, the default) or
3-digit addition (`add`).

Its warm start imitates a noisy demonstrator: on prompts disjoint from the RL and eval sets,
each answer is right with probability `--teacher-exact` (0.25), every digit of it replaced by
another digit with probability 1 - 0.25^(1/digits). A policy that has learnt the demonstrator
knows the task on every prompt yet samples a whole right answer about a quarter of the time;
GRPO then has to beat its teacher, and runs until the held-out eval's exact match reaches the
target or the time budget (`--time-budget-s`, 480) is spent, colocated on the one GPU (engine and
trainer on it together, weights handed over in memory). `--rollout-precision fp8` serves the
rollouts from block-FP8 weights requantized at every sync (`[sync] precision = "fp8"`) and
corrects the train/rollout mismatch with token-level truncated importance sampling (`[train]
tis_mode = "truncate"`). `--lora-rank R` keeps the full-parameter warm start and runs the RL phase
as LoRA on its frozen result (`[train] lora_rank`, alpha 2 x R, at `--lora-lr`, default 10 x
`--rl-lr`): every sync hands the engine the adapter alone (rltool.loop.lora_sync). `--arch
qwen3_5` runs the same recipe on a Qwen3.5-style hybrid (Gated DeltaNet layers with attention
every fourth layer, preset hybrid-0.7b; `RECIPES["qwen3_5"]`), its engine keeping fp32 recurrent
states unless `--mamba-ssm-dtype bf16`. Each step prints reward, eval reward and phase times;
`--preset tiny` (a hybrid: tiny-4l) runs the recipe on CPU. docs/loop.md, "The GPU demo".
"""

from __future__ import annotations

import random
import string
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rltool.demo_common import (HEADER, TARGET, Clock, device_name, finish, fresh, print_row,
                                summarize, window_mean)
from rltool.errors import BadInputError

KV_TOKENS = 65536  # the recipes' KV pool: 512 rollouts of at most ~40 tokens fit many times
PRECISIONS = ("bf16", "fp8")  # --rollout-precision: the weights the engine serves
LORA_LR_FACTOR = 10.0  # --lora-lr's default, times --rl-lr (GpuRecipe.lora_lr)
MISMATCH_KEYS = ("train/train_rollout_logprob_abs_diff", "train/mismatch_kl",
                 "train/mismatch_k3_kl", "train/tis_clipfrac")
# The CPU shapes of each arch's recipe (`--preset` on cpu by default): tiny's widths, and for the
# hybrid 4 layers, so that it has 3 Gated DeltaNet layers and 1 attention layer.
ARCH_PRESETS = {"qwen2": "tiny", "qwen3_5": "tiny-4l"}
SSM_DTYPES = ("fp32", "bf16")  # --mamba-ssm-dtype


@dataclass(frozen=True)
class TaskSpec:
    """A GPU recipe's task: digit lengths of its prompts, the most response tokens, and the
    warm start's steps (`--sft-steps`)."""

    min_len: int
    max_len: int
    max_response_len: int
    sft_steps: int


TASKS = {
    # sums of two 3-digit numbers, at most 4 digits and EOS; clean demonstrations took ~300
    # steps on the H200 before sums came out right
    "add": TaskSpec(3, 3, 8, 500),
    # 8-12 digits reversed and EOS; clean demonstrations: ~75 steps (loss 0.92 at step 50, 0.14
    # at 75)
    "reverse": TaskSpec(8, 12, 16, 200),
}


def check_teacher_exact(teacher_exact: float) -> None:
    if not 0.0 < teacher_exact <= 1.0:
        raise BadInputError(f"--teacher-exact must be in (0, 1], got {teacher_exact:g}")


@dataclass(frozen=True)
class GpuRecipe:
    """The GPU recipes' settings (tables in `gpu_loop_tables`); batch sizes and rates are chosen
    for the 0.5B shapes on one H200 (docs/loop.md, "The GPU demo")."""

    task: str = "reverse"  # or add (TASKS)
    rollout_batch_size: int = 64  # prompts per step
    n_samples_per_prompt: int = 8  # 512 rollouts a step
    eval_prompts: int = 256
    sft_prompts: int = 20000  # tokenizing the set is part of every warm-start call
    sft_lr: float = 3e-4
    rl_lr: float = 4e-5
    eval_interval: int = 5
    time_budget_s: float = 480.0
    sft_batch: int = 256  # or the whole SFT set when smaller
    teacher_exact: float = 0.25  # the demonstrator's chance of a whole right answer
    rollout_precision: str = "bf16"  # or fp8 (see `add_loop_tables`)
    lora_rank: int = 0  # RL as LoRA of this rank on the warm-started base (0: full parameters)
    # LoRA's RL learning rate, None: LORA_LR_FACTOR x rl_lr (the adapters start at zero and move
    # the model through a rank-R update: on the CPU the trainer's LoRA needed about 10x the full
    # fine-tuning rate for the same progress per step)
    lora_lr: float | None = None
    arch: str = "qwen2"  # or qwen3_5, the hybrid (ARCH_PRESETS)
    preset: str = "qwen2.5-0.5b"  # the model shapes (the CLI's default on cpu: ARCH_PRESETS)
    # qwen3_5: the engine's recurrent-state dtype (--mamba-ssm-dtype); None for qwen2
    mamba_ssm_dtype: str | None = None

    def __post_init__(self) -> None:  # before the demo writes anything
        if self.arch not in ARCH_PRESETS:
            raise BadInputError(f"unknown --arch {self.arch!r}; choose one of "
                                f"{', '.join(ARCH_PRESETS)}")
        hybrid = self.arch == "qwen3_5"
        if hybrid != (self.mamba_ssm_dtype is not None) or self.mamba_ssm_dtype not in (
                None, *SSM_DTYPES):
            raise BadInputError("--mamba-ssm-dtype (fp32 or bf16) is the hybrid's recurrent "
                                "state: use it with --arch qwen3_5 only")
        if not self.rl_lr > 0:
            raise BadInputError(f"--rl-lr must be > 0, got {self.rl_lr:g}")
        if self.lora_rank < 0 or (self.lora_lr is not None and not self.lora_lr > 0):
            raise BadInputError("--lora-rank must be >= 0 and --lora-lr > 0")
        if self.lora_lr is not None and not self.lora_rank:
            raise BadInputError("--lora-lr is the LoRA RL rate: add --lora-rank R (>= 1)")
        if self.lora_rank and hybrid:
            raise BadInputError("--lora-rank: the engine serves no LoRA adapter on a hybrid "
                                "linear-attention model; drop --lora-rank with --arch qwen3_5")
        if self.lora_rank and self.rollout_precision != "bf16":
            raise BadInputError("--lora-rank serves the adapter over bf16 weights: drop "
                                "--rollout-precision fp8 (the engine serves no LoRA over FP8)")
        check_teacher_exact(self.teacher_exact)

    @property
    def rl_train(self) -> dict[str, Any]:
        """The RL phase's [train] keys that LoRA changes: the learning rate and the rank."""
        if not self.lora_rank:
            return {"lr": self.rl_lr}
        lr = self.lora_lr if self.lora_lr is not None else LORA_LR_FACTOR * self.rl_lr
        return {"lr": lr, "lora_rank": self.lora_rank}


RECIPES = {
    "qwen2": GpuRecipe(),
    # The hybrid on the dense recipe's settings: hybrid-0.7b with the task vocabulary has ~0.37B
    # parameters (24 layers of width 1024 against the 0.5B shapes' 24 of 896, about as many),
    # so the warm start's 200 steps cost about the dense model's (~127 s on the H200) plus the
    # trainer's torch Gated DeltaNet (transformers' chunked path: one 64-token chunk per row
    # here, a triangular solve per layer), and 5 RL steps reached the target on the dense model.
    # The engine decodes it eagerly (no CUDA graphs for hybrids); 512 rollouts of <= 16 tokens
    # take 16 decode steps. fp32 recurrent states: the engine's default, stated so the run's
    # config records it (benchmarks/hybrid_mismatch.py measures bf16 against it).
    "qwen3_5": GpuRecipe(arch="qwen3_5", preset="hybrid-0.7b", mamba_ssm_dtype="fp32"),
}


def recipe_for(arch: str, **overrides: Any) -> GpuRecipe:
    """`RECIPES[arch]` with the settings given (None: the recipe's own)."""
    if arch not in RECIPES:
        raise BadInputError(f"unknown --arch {arch!r}; choose one of {', '.join(RECIPES)}")
    return replace(RECIPES[arch], **{k: v for k, v in overrides.items() if v is not None})


def gpu_loop_tables(root: Path, *, model: Path, steps: int, seed: int, device: str,
                    recipe: GpuRecipe) -> dict[str, Any]:
    """The recipe's loop config: exact-match GRPO on the task's RL prompts, colocated on
    `device` with the in-process engine, the eval set sampled like the rollouts (temperature 1,
    one sample per prompt), two optimizer steps per rollout step, checkpoints only at the end.
    rollout_precision fp8: every sync block-quantizes the trainer's weights (`[sync] precision =
    "fp8"`, the engine serves FP8 weights from version 0 on), and the policy loss weighs each
    token by the truncated ratio min(pi_old / pi_rollout, 2) (token-level TIS, slime's
    --use-tis): every token keeps its gradient, scaled by how far the FP8 engine's probability of
    it is from the trainer's."""
    rollouts = recipe.rollout_batch_size * recipe.n_samples_per_prompt
    fp8 = recipe.rollout_precision == "fp8"
    return {
        "model": {"path": str(model)},
        "rollout": {"prompts": str(root / "rl.jsonl"), "reward": f"{recipe.task}:exact",
                    "n_samples_per_prompt": recipe.n_samples_per_prompt,
                    "rollout_batch_size": recipe.rollout_batch_size,
                    "max_response_len": TASKS[recipe.task].max_response_len,
                    "temperature": 1.0, "seed": seed,
                    # every sample in flight at once (the engine batches what it can run)
                    "concurrency": rollouts},
        "train": {**recipe.rl_train, "lr_warmup_steps": 2,
                  "global_batch_size": rollouts // 2,
                  "advantage_estimator": "grpo",
                  **({"tis_mode": "truncate", "tis_clip_high": 2.0} if fp8 else {})},
        "sync": {"sync": "auto", **({"precision": "fp8"} if fp8 else {})},
        "eval": {"prompts": str(root / "eval.jsonl"), "n_samples_per_prompt": 1},
        # The model is small: trainer (16 bytes a parameter) and engine (weights, a KV pool
        # capped at 64k tokens, decode graphs captured once) stay on the device together, so
        # nothing is offloaded or released between phases and the sync is a device copy.
        "loop": {"num_steps": steps, "placement": "colocated", "num_engines": 1, "seed": seed,
                 "engine": "inprocess", "device": device, "eval_interval": recipe.eval_interval,
                 "save_interval": max(steps, 1), "offload": "none",
                 "engine_args": ["--max-running-requests", str(rollouts),
                                 "--cuda-graph-max-bs", str(rollouts),
                                 "--max-total-tokens", str(KV_TOKENS),
                                 *(["--mamba-ssm-dtype", recipe.mamba_ssm_dtype]
                                   if recipe.mamba_ssm_dtype else [])]},
    }


def make_task_data(root: Path, clock: Clock, recipe: GpuRecipe) -> int:
    """Write the RL, eval and (noisy) SFT prompt files; returns the SFT prompts' count."""
    from rltool.data.tasks import make_rows, write_prompts

    spec = TASKS[recipe.task]
    lengths = dict(min_len=spec.min_len, max_len=spec.max_len)
    rl = make_rows(recipe.task, num=4096, seed=1, **lengths)
    held_out = make_rows(recipe.task, num=recipe.eval_prompts, seed=3, **lengths)
    taken = {r["prompt"] for r in rl + held_out}
    sft = [r for r in make_rows(recipe.task, num=recipe.sft_prompts, seed=2, **lengths)
           if r["prompt"] not in taken]
    sft = noisy_demonstrations(sft, teacher_exact=recipe.teacher_exact, seed=2)
    write_prompts(rl, root / "rl.jsonl")
    write_prompts(held_out, root / "eval.jsonl")
    write_prompts(sft, root / "sft.jsonl")
    clock.say(f"rltool data make --task {recipe.task} --min-len {spec.min_len} --max-len "
              f"{spec.max_len}: {len(rl)} RL prompts (seed 1), {len(held_out)} eval prompts "
              f"(seed 3), {len(sft)} SFT prompts (seed 2) none of which is an RL or eval prompt, "
              f"their answers from a demonstrator right {recipe.teacher_exact:g} of the time")
    return len(sft)


def noisy_demonstrations(rows: list[dict[str, Any]], *, teacher_exact: float,
                         seed: int) -> list[dict[str, Any]]:
    """The rows with each label's digits replaced, independently, by another digit with
    probability 1 - teacher_exact^(1/digits): a label stays whole with probability teacher_exact
    whatever its length."""
    check_teacher_exact(teacher_exact)
    rng = random.Random(seed)
    out = []
    for row in rows:
        label = row["label"]
        flip = 1.0 - teacher_exact ** (1.0 / max(1, sum(c.isdigit() for c in label)))
        noisy = "".join(rng.choice([d for d in string.digits if d != c])
                        if c.isdigit() and rng.random() < flip else c for c in label)
        out.append({**row, "label": noisy})
    return out


def gpu_warm_start(root: Path, model: Path, *, steps: int, sft_prompts: int, seed: int,
                   device: str, recipe: GpuRecipe, clock: Clock) -> Path:
    """`steps` supervised steps on the `sft_prompts` (noisy) SFT prompts; returns the published
    weights."""
    from rltool.train import run as run_train
    from rltool.train.config import TrainConfig

    batch = min(recipe.sft_batch, sft_prompts)
    result = run_train(TrainConfig(
        loss="sft", prompts=str(root / "sft.jsonl"), load=str(model),
        save=str(root / "sft" / "ckpt"), publish=str(root / "sft" / "weights"),
        metrics=str(root / "sft" / "train.jsonl"), lr=recipe.sft_lr,
        lr_warmup_steps=min(20, steps), global_batch_size=batch, num_steps=steps, seed=seed,
        device=device, dtype="bf16" if device == "cuda" else "fp32"))
    losses = [m["train/sft_loss"] for m in result.metrics if "train/sft_loss" in m]
    clock.say(f"rltool train --loss sft --num-steps {steps} --global-batch-size {batch} --lr "
              f"{recipe.sft_lr:g}: supervised warm start, mean token loss of the last 10 steps "
              f"{window_mean(losses, 10):.3f}")
    assert result.published is not None
    return Path(result.published)


def run_gpu_recipe(root: Path, *, steps: int, sft_steps: int | None, seed: int, device: str,
                   recipe: GpuRecipe) -> dict[str, Any]:
    """The GPU recipe (`--task add|reverse`; `--device cuda` runs reverse by default): see the
    module docstring."""
    import tomli_w

    from rltool import atomic
    from rltool.data.models import init_model
    from rltool.loop import runner
    from rltool.loop.config import LoopSettings

    fresh(root)
    clock = Clock()
    preset = recipe.preset
    model = init_model(root / "model", arch=recipe.arch, preset=preset, task=recipe.task,
                       seed=seed, fit_vocab=True)
    clock.say(f"rltool init-model --arch {recipe.arch} --preset {preset} --task {recipe.task} "
              f"--seed {seed} "
              f"(vocabulary of the task tokenizer): random-init model {model}")
    sft_prompts = make_task_data(root, clock, recipe)
    sft_steps = TASKS[recipe.task].sft_steps if sft_steps is None else sft_steps
    policy = gpu_warm_start(root, model, steps=sft_steps, sft_prompts=sft_prompts, seed=seed,
                            device=device, recipe=recipe, clock=clock)
    tables = gpu_loop_tables(root, model=policy, steps=steps, seed=seed, device=device,
                             recipe=recipe)
    atomic.write_text(root / "run.toml", tomli_w.dumps(tables))
    deadline = clock.t0 + recipe.time_budget_s
    clock.say(f"rltool loop --config {root / 'run.toml'} --run-dir {root / 'run'}: at most "
              f"{steps} steps of {recipe.rollout_batch_size} prompts x "
              f"{recipe.n_samples_per_prompt} samples, exact-match "
              f"GRPO on {device}, {recipe.rollout_precision} rollout weights"
              + (" with truncated importance sampling" if recipe.rollout_precision == "fp8"
                 else "")
              + (f", LoRA rank {recipe.lora_rank} at lr {recipe.rl_train['lr']:g} on the frozen "
                 "warm-started base (each sync moves the adapter alone)" if recipe.lora_rank
                 else "") + f"; stops once the eval exact match reaches {TARGET} or at "
              f"{recipe.time_budget_s:.0f}s")
    print(HEADER)

    def stop(rows: list[dict[str, Any]]) -> bool:
        return rows[-1].get("eval/mean_reward", 0.0) >= TARGET or time.perf_counter() > deadline

    runner.start(LoopSettings.from_tables(tables), root / "run", on_step=print_row,
                 stop_when=stop)
    finish(root, clock)
    evals = [r for r in _rows(root, "loop") if "eval/mean_reward" in r]
    hit = next((r for r in evals if r["eval/mean_reward"] >= TARGET), None)
    extra = {"device": device, "arch": recipe.arch, "preset": preset,
             "mamba_ssm_dtype": recipe.mamba_ssm_dtype, "device_name": device_name(device),
             "rollout_precision": recipe.rollout_precision,
             "teacher_exact": recipe.teacher_exact, "rl_lr": recipe.rl_train["lr"],
             "lora_rank": recipe.lora_rank,
             "target_eval_exact": TARGET, "time_budget_s": recipe.time_budget_s,
             "eval_step_reaching_target": hit["step"] if hit else None,
             "seconds_to_target": hit["time"] - clock.t0_wall if hit else None,
             "final_eval_reward": evals[-1]["eval/mean_reward"] if evals else None,
             # the train/rollout mismatch, mean over the optimizer steps (bf16 vs fp8 rollouts)
             "mismatch_means": {k: sum(v) / len(v) for k in MISMATCH_KEYS
                                if (v := [r[k] for r in _rows(root, "train") if k in r])}}
    summary = summarize(root, root / "run", sft_steps=sft_steps, seed=seed,
                        started=clock.t0, task=recipe.task, extra=extra)
    print(f"\nfirst RL step exact match {summary['first_rl_reward']:.3f}; eval exact match "
          + (f"reached {TARGET} at step {hit['step']} after {extra['seconds_to_target']:.0f}s"
             if hit else f"NOT at {TARGET} (last {extra['final_eval_reward']})")
          + f"; total {summary['total_s']:.0f}s on {extra['device_name']}")
    return summary


def _rows(root: Path, stage: str) -> list[dict[str, Any]]:
    from rltool.rundir import read_metrics

    return read_metrics(root / "run" / "metrics" / f"{stage}.jsonl")

