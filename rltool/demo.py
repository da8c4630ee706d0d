"""`make demo`: the whole RL loop on a CPU, from a random-init model, visibly learning.

1. a tiny random-init qwen2 model for the `copy` task (`rltool init-model`, seed 0);
2. prompt sets (`rltool data make`): RL prompts (3-digit copy), held-out eval prompts, and SFT
   prompts (1-3 digit copy) with every string that appears in the RL or eval sets removed;
3. a short supervised warm start (`rltool train --loss sft`) that stops while the reward on the
   RL prompts is still low (pure RL from random init never finds the answer format);
4. `rltool loop`: rollout -> GRPO train -> publish -> engine update, printing one line per step;
5. `rltool report`: reward-vs-step PNG (and the other plots) and a summary.

Every stage is the library call behind the command printed next to it. Seeds are fixed and
stated: `--seed S` seeds the model init, both trainers and the engine's sampling (the rollout
seed gives every sample its own `sampling_seed`, from S and its uid); the prompt sets keep their
own seeds, so every seed learns the same task. The measured curves are in docs/loop.md.

`--device cuda` is the GPU counterpart: reversing 8-12 digit strings (or, `--task add`, 3-digit
addition) on the Qwen2.5-0.5B shapes, or with `--arch qwen3_5` on the hybrid-0.7b Gated DeltaNet
hybrid (rltool.demo_gpu, which also holds `--rollout-precision fp8`); `--out-json FILE` writes
the summary. `--task add --preset tiny` (`--arch qwen3_5`: tiny-4l) runs that recipe on CPU.
The copy demo is the tiny qwen2 only: its recipe is tuned to it.

Run: `python -m rltool.demo [DIR] [--device cpu|cuda] [--task copy|add|reverse]
[--arch qwen2|qwen3_5] [--preset P] [--seed S] [--steps N] [--sft-steps N]
[--rollout-precision bf16|fp8] [--out-json FILE] [-q]` (default DIR `demo-run`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from rltool.demo_common import (HEADER, TARGET, WINDOW, Clock, chunked_warm_start, finish,
                                fresh, print_row, summarize, window_mean)
from rltool.demo_gpu import (ARCH_PRESETS, PRECISIONS, SSM_DTYPES, TASKS, recipe_for,
                             run_gpu_recipe)
from rltool.errors import BadInputError, RltoolError

TASK = "copy"
SEED = 0
# The warm start goes on past --sft-steps while its loss is above this. The loss falls from
# ~1.4 to below 1 within ~10 steps once the model starts to copy; RL from before that drop left
# a position it never copied for some seeds (the policy turned deterministic on a wrong digit
# there first), so the warm start stops past it: 60-140 steps for seeds 0-9 (docs/loop.md).
SFT_LOSS_TARGET = 0.9
SFT_EXTRA_STEPS = 10
SFT_MAX_STEPS = 200


def loop_tables(root: Path, *, model: Path, steps: int, seed: int = SEED) -> dict[str, Any]:
    """The demo's loop config (also written to DIR/run.toml; examples/demo.toml documents it)."""
    return {
        "model": {"path": str(model)},
        "rollout": {"prompts": str(root / "rl.jsonl"), "reward": f"{TASK}:partial",
                    "n_samples_per_prompt": 8, "rollout_batch_size": 16, "max_response_len": 8,
                    "temperature": 1.0, "seed": seed},
        # 128 samples per step in 2 optimizer steps of 64; a short warmup keeps Adam's first,
        # sign-like steps from wrecking the warm start. At 3e-3 one optimizer step could move the
        # policy by 0.2-0.5 nats a token and make it stop ending its answers, after which every
        # reward is 0 and no gradient is left (measured: docs/loop.md).
        "train": {"lr": 2e-3, "lr_warmup_steps": 5, "global_batch_size": 64,
                  "advantage_estimator": "grpo"},
        # auto: the colocated engine takes the weights in memory (here a copy into the
        # in-process engine); checkpoints every save_interval steps and at the end.
        "sync": {"sync": "auto"},
        "eval": {"prompts": str(root / "eval.jsonl"), "n_samples_per_prompt": 4},
        # The engine on a thread of the loop process: no HTTP/JSON per call (docs/loop.md).
        "loop": {"num_steps": steps, "placement": "colocated", "num_engines": 1, "seed": seed,
                 "engine": "inprocess", "eval_interval": 15,
                 "engine_args": ["--max-running-requests", "128"]},
    }



def make_data(root: Path, clock: Clock) -> None:
    from rltool.data.tasks import make_rows, write_prompts

    rl = make_rows(TASK, num=256, seed=1, min_len=3, max_len=3)
    held_out = make_rows(TASK, num=64, seed=3, min_len=3, max_len=3)
    taken = {r["label"] for r in rl + held_out}
    sft = [r for r in make_rows(TASK, num=4096, seed=2, min_len=1, max_len=3)
           if r["label"] not in taken]
    write_prompts(rl, root / "rl.jsonl")
    write_prompts(held_out, root / "eval.jsonl")
    write_prompts(sft, root / "sft.jsonl")
    clock.say(f"rltool data make --task copy --min-len 3 --max-len 3: {len(rl)} RL prompts "
              f"(seed 1), {len(held_out)} eval prompts (seed 3)")
    clock.say(f"rltool data make --task copy --min-len 1 --max-len 3 (seed 2): {len(sft)} SFT "
              "prompts, none of whose strings appear in the RL or eval prompts")


def warm_start(root: Path, model: Path, *, sft_steps: int, seed: int,
               clock: Clock) -> tuple[Path, int]:
    """`sft_steps` supervised steps, then SFT_EXTRA_STEPS more at a time (resumed from the
    checkpoint) while the mean loss of the last 10 steps is above SFT_LOSS_TARGET, at most
    SFT_MAX_STEPS in all. Model inits start copying after different numbers of steps (seed 1
    after 60, seed 7 after 140), so the warm start ends on the loss, not on a step count."""
    from rltool.train.config import TrainConfig

    def config(*, load: str, save: str, num_steps: int, first: bool) -> TrainConfig:
        return TrainConfig(loss="sft", prompts=str(root / "sft.jsonl"), load=load, save=save,
                           publish=str(root / "sft" / "weights"),
                           metrics=str(root / "sft" / "train.jsonl"), lr=3e-3,
                           global_batch_size=32, num_steps=num_steps, seed=seed)

    policy, steps, losses = chunked_warm_start(
        root, model, first_steps=sft_steps, chunk_steps=SFT_EXTRA_STEPS,
        max_steps=max(SFT_MAX_STEPS, sft_steps), config=config,
        done=lambda losses: window_mean(losses, 10) <= SFT_LOSS_TARGET)
    clock.say(f"rltool train --loss sft --num-steps {steps} --global-batch-size 32 --lr 3e-3:"
              " supervised warm start, mean sft loss of the last 10 steps "
              f"{window_mean(losses, 10):.3f}")
    return policy, steps


def run(root: Path, *, steps: int, sft_steps: int, seed: int = SEED) -> dict[str, Any]:
    from rltool import atomic
    from rltool.data.models import init_model
    from rltool.loop import runner
    from rltool.loop.config import LoopSettings

    fresh(root)
    clock = Clock()
    started = clock.t0
    model = init_model(root / "model", arch="qwen2", preset="tiny", task=TASK, seed=seed)
    clock.say(f"rltool init-model --preset tiny --task {TASK} --seed {seed}: random-init model "
              f"{model}")
    make_data(root, clock)
    policy = model
    if sft_steps:
        policy, sft_steps = warm_start(root, model, sft_steps=sft_steps, seed=seed, clock=clock)
        print("  (a short supervised warm start on prompts disjoint from the RL prompts: pure RL "
              "from random init never finds the answer format on a CPU budget)")
    tables = loop_tables(root, model=policy, steps=steps, seed=seed)
    import tomli_w

    atomic.write_text(root / "run.toml", tomli_w.dumps(tables))
    clock.say(f"rltool loop --config {root / 'run.toml'} --run-dir {root / 'run'}: {steps} steps "
              f"of 16 prompts x 8 samples at most, GRPO, colocated engine; stops once the "
              f"mean reward of the last {WINDOW} steps reaches {TARGET}")
    print(HEADER)
    runner.start(LoopSettings.from_tables(tables), root / "run", on_step=print_row,
                 stop_when=lambda rows: len(rows) >= WINDOW and window_mean(
                     [r["rollout/raw_reward"] for r in rows]) >= TARGET)
    finish(root, clock)
    summary = summarize(root, root / "run", sft_steps=sft_steps, seed=seed, started=started,
                        task=TASK)
    first, best = summary["first_rl_reward"], summary["best_rl_reward"]
    print(f"\nreward vs step: {root / 'run' / 'report' / 'reward.png'}")
    sustained = summary[f"first_step_mean{WINDOW}_reaching_target"]
    print(f"first RL step reward {first:.3f} -> mean of the last {WINDOW} steps "
          f"{summary['final_mean5_reward']:.3f} (best single step {best:.3f}); target {TARGET} "
          + (f"reached at step {sustained} ({WINDOW}-step mean)" if sustained is not None
             else "NOT reached")
          + f"; total {summary['total_s']:.0f}s (seed {seed}, {os.cpu_count()} CPU cores)")
    return summary



def main(argv: list[str] | None = None) -> None:
    # One torch thread per process: the loop process and its engine share the cores, and
    # oversubscribed threads made every step several times slower on a 2-core machine.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="python -m rltool.demo", description=__doc__.split(
        "\n")[0])
    parser.add_argument("dir", nargs="?", default="demo-run", help="Demo directory (recreated).")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the GPU "
                        "demo (the reversal recipe on the 0.5B shapes unless --task/--preset "
                        "say otherwise).")
    parser.add_argument("--task", choices=("copy", *TASKS), default=None, help="copy (the CPU "
                        "demo; default on cpu), reverse (8-12 digit strings reversed, exact "
                        "match; default on cuda) or add (3-digit sums, exact match).")
    parser.add_argument("--arch", choices=tuple(ARCH_PRESETS), default="qwen2",
                        help="add/reverse: qwen2 (dense) or qwen3_5 (the Gated DeltaNet hybrid: "
                        "preset hybrid-0.7b on cuda, tiny-4l on cpu).")
    parser.add_argument("--preset", default=None, help="add/reverse: the model shapes "
                        "(default qwen2.5-0.5b on cuda, tiny on cpu; see --arch).")
    parser.add_argument("--mamba-ssm-dtype", choices=SSM_DTYPES, default=None,
                        help="--arch qwen3_5: the engine's recurrent-state dtype (default fp32).")
    parser.add_argument("--steps", type=int, default=None, help="Most RL loop steps (copy: 150, "
                        f"stops once the {WINDOW}-step mean reward reaches {TARGET}; "
                        f"add/reverse: 200, stops once the eval exact match reaches {TARGET} or at the time "
                        "budget).")
    parser.add_argument("--sft-steps", type=int, default=None, help="Supervised warm-start "
                        "steps (copy: 60, 0 is pure RL; add/reverse: 500 / 200).")
    parser.add_argument("--teacher-exact", type=float, default=None,
                        help="add/reverse: how often the warm start's demonstrator answers "
                        "whole and right (1 is clean demonstrations).")
    parser.add_argument("--rl-lr", type=float, default=None,
                        help="add/reverse: the GRPO learning rate.")
    parser.add_argument("--rollout-batch-size", type=int, default=None,
                        help="add/reverse: prompts per RL step.")
    parser.add_argument("--n-samples-per-prompt", type=int,
                        default=None,
                        help="add/reverse: samples per prompt (the GRPO group).")
    parser.add_argument("--eval-prompts", type=int, default=None,
                        help="add/reverse: held-out eval prompts.")
    parser.add_argument("--sft-prompts", type=int, default=None,
                        help="add/reverse: SFT prompts drawn (those equal to an RL or eval prompt "
                        "are left out).")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="add/reverse: stop RL once this many seconds have passed since "
                        "the demo began.")
    parser.add_argument("--rollout-precision", choices=PRECISIONS, default="bf16",
                        help="add/reverse: fp8 serves the rollouts from block-FP8 weights "
                        "requantized at every sync, with truncated importance sampling.")
    parser.add_argument("--lora-rank", type=int, default=0, help="add/reverse: RL as LoRA of "
                        "this rank on the warm-started model (0: full parameters).")
    parser.add_argument("--lora-lr", type=float, default=None, help="add/reverse with "
                        "--lora-rank: the LoRA RL learning rate (default 10 x --rl-lr).")
    parser.add_argument("--out-json", default=None, help="Also write the summary JSON here.")
    parser.add_argument("--seed", type=int, default=SEED, help="Seed of the model init, the "
                        "trainers and the engine's sampling (the prompt sets keep theirs).")
    parser.add_argument("--json", action="store_true", help="Print the summary as JSON.")
    parser.add_argument("-q", "--quiet", action="store_true", help="No progress bars or "
                        "progress lines (the step table and the summary still print).")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    task = args.task or ("reverse" if args.device == "cuda" else "copy")
    from rltool.logs import setup_logging

    setup_logging(verbosity=-1)  # the step table is the demo's output; warnings still show
    if not args.quiet:  # and the progress of the warm start and of each step's training
        logging.getLogger("rltool.progress").setLevel(logging.INFO)
    try:
        if task == "copy":
            if (args.device != "cpu" or args.preset not in (None, "tiny")
                    or args.rollout_precision != "bf16" or args.lora_rank
                    or args.arch != "qwen2" or args.mamba_ssm_dtype):
                raise BadInputError("--task copy is the CPU demo (tiny qwen2 model on the CPU); "
                                    "use --task add or reverse with --device cuda, --arch, "
                                    "--preset, --rollout-precision or --lora-rank")
            summary = run(Path(args.dir), steps=150 if args.steps is None else args.steps,
                          sft_steps=60 if args.sft_steps is None else args.sft_steps,
                          seed=args.seed)
        else:
            from rltool.data.models import parse_device

            parse_device(args.device)  # before the demo directory is recreated
            recipe = recipe_for(
                args.arch, task=task, rollout_batch_size=args.rollout_batch_size,
                n_samples_per_prompt=args.n_samples_per_prompt, eval_prompts=args.eval_prompts,
                sft_prompts=args.sft_prompts, time_budget_s=args.time_budget_s,
                rollout_precision=args.rollout_precision, teacher_exact=args.teacher_exact,
                rl_lr=args.rl_lr, lora_rank=args.lora_rank, lora_lr=args.lora_lr,
                mamba_ssm_dtype=args.mamba_ssm_dtype,
                preset=args.preset or (None if args.device == "cuda"
                                       else ARCH_PRESETS[args.arch]))
            summary = run_gpu_recipe(
                Path(args.dir), steps=200 if args.steps is None else args.steps,
                sft_steps=args.sft_steps, seed=args.seed, device=args.device, recipe=recipe)
    except RltoolError as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    if args.out_json:
        from rltool import atomic

        atomic.write_json(Path(args.out_json), summary)
    if args.json:
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
