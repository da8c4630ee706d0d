import sys

import click

from rltool.commands.common import (config_option, echo_json, explicit_flags, handle_errors,
                                    json_option, quiet_option, setup_logging, split_dirs)


@click.command("train")
@click.option("--rollouts", multiple=True, callback=split_dirs,
              help="Rollout shard directories (DIR[,DIR...]; repeatable).")
@click.option("--prompts", default=None, help="Prompts JSONL for --loss sft without shards "
              "(target = label + EOS).")
@click.option("--load", default=None, help="HF weights dir, a checkpoint step-NNNNNN, or a --save "
              "dir (newest checkpoint).")
@click.option("--save", default=None, help="Checkpoint parent (RUN/train/ckpt).")
@click.option("--publish", default=None, help="Publish parent (RUN/weights): weight_vNNNNNN.")
@click.option("--sync", type=click.Choice(["full", "delta", "auto"]), default=None,
              help="Publish full checkpoints (default), deltas on the previous published "
              "version, or auto (cost model; docs/delta.md).")
@click.option("--delta-format", type=click.Choice(["rltool", "slime"]), default=None,
              help="Delta format for --sync delta|auto (default rltool).")
@click.option("--delta-encoding", type=click.Choice(["xor", "overwrite"]), default=None,
              help="slime delta encoding (default xor).")
@click.option("--full-every", type=int, default=None,
              help="A full version every M versions keeps pull chains short (default 10).")
@click.option("--link-bandwidth-gbps", type=float, default=None,
              help="Trainer-to-engine bandwidth for --sync auto (default: measured).")
@click.option("--ref", default=None, help="Reference weights for the KL terms.")
@click.option("--metrics", default=None, help="train.jsonl path.")
@click.option("--loss", type=click.Choice(["policy", "sft"]), default=None,
              help="policy (default) or sft.")
@click.option("--advantage-estimator", type=click.Choice(
    ["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]), default=None,
    help="Advantage estimator (default grpo; ppo = GAE with a value head).")
@click.option("--grpo-std-normalization/--no-grpo-std-normalization", default=None,
              help="Divide GRPO advantages by the group std (off = Dr.GRPO).")
@click.option("--gamma", type=float, default=None, help="reinforce_plus_plus / ppo discount.")
@click.option("--lambd", type=float, default=None, help="GAE lambda (ppo, default 1.0).")
@click.option("--value-clip", type=float, default=None, help="PPO value clip (default 0.2).")
@click.option("--value-loss-coef", type=float, default=None, help="Value loss weight (default 1).")
@click.option("--eps-clip", type=float, default=None, help="PPO clip range (default 0.2).")
@click.option("--eps-clip-high", type=float, default=None, help="PPO clip range, high side.")
@click.option("--eps-clip-c", type=float, default=None, help="Dual-clip constant c > 1.")
@click.option("--kl-coef", type=float, default=None, help="KL reward shaping (reinforce++).")
@click.option("--kl-loss-coef", type=float, default=None, help="KL loss term coefficient.")
@click.option("--kl-loss-type", type=click.Choice(["k1", "k2", "k3", "low_var_kl"]), default=None,
              help="KL estimator (default low_var_kl).")
@click.option("--entropy-coef", type=float, default=None, help="Entropy bonus coefficient.")
@click.option("--loss-aggregation", type=click.Choice(["token", "sequence", "group"]),
              default=None, help="Loss aggregation (default token).")
@click.option("--tis-mode", type=click.Choice(["none", "truncate", "clip", "icepop"]),
              default=None, help="Train/rollout importance weights (docs/train-mismatch.md).")
@click.option("--tis-level", type=click.Choice(["token", "sequence", "geometric"]), default=None,
              help="TIS ratio level (default token).")
@click.option("--tis-clip-low", type=float, default=None, help="TIS clip / ICEPOP band low (0).")
@click.option("--tis-clip-high", type=float, default=None, help="TIS clip / ICEPOP band high (2).")
@click.option("--rs-level", type=click.Choice(["none", "token", "sequence", "geometric"]),
              default=None, help="Rejection sampling level (default none).")
@click.option("--rs-low", type=float, default=None, help="Rejection band low (default 1/high).")
@click.option("--rs-high", type=float, default=None, help="Rejection band high (default 2).")
@click.option("--rs-veto-threshold", type=float, default=None,
              help="Drop samples with any token ratio below this.")
@click.option("--bypass/--no-bypass", default=None,
              help="Rollout logprobs as old logprobs, no recompute (--use-rollout-logprobs).")
@click.option("--lr", type=float, default=None, help="Peak learning rate (default 1e-6).")
@click.option("--min-lr", type=float, default=None, help="Final cosine learning rate.")
@click.option("--lr-warmup-steps", type=int, default=None, help="Linear warmup steps.")
@click.option("--lr-decay-style", type=click.Choice(["constant", "cosine"]), default=None,
              help="LR after warmup.")
@click.option("--lr-decay-steps", type=int, default=None, help="Cosine decay length.")
@click.option("--weight-decay", type=float, default=None, help="AdamW weight decay.")
@click.option("--adam-beta1", type=float, default=None, help="AdamW beta1.")
@click.option("--adam-beta2", type=float, default=None, help="AdamW beta2.")
@click.option("--adam-eps", type=float, default=None, help="AdamW epsilon.")
@click.option("--clip-grad", type=float, default=None, help="Max gradient norm (0 = off).")
@click.option("--global-batch-size", type=int, default=None, help="Samples per optimizer step.")
@click.option("--num-epochs", type=int, default=None, help="Passes over the samples.")
@click.option("--num-steps", type=int, default=None, help="Optimizer steps (overrides epochs).")
@click.option("--shuffle/--no-shuffle", default=None, help="Shuffle samples each epoch.")
@click.option("--max-tokens-per-microbatch", type=int, default=None,
              help="Token cap per micro-batch (default 4096).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default=None, help="fp32 or bf16.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="auto (default): CUDA when available; cpu: match a CPU engine.")
@click.option("--parallel", type=click.Choice(["ddp", "fsdp"]), default=None,
              help="Data parallelism under torchrun.")
@click.option("--deterministic/--no-deterministic", default=None,
              help="One unpadded forward per sample (exact engine alignment).")
@click.option("--seed", type=int, default=None, help="Seed.")
@click.option("--save-interval", type=int, default=None, help="Checkpoint every N steps too.")
@click.option("--nproc-per-node", type=int, default=1, show_default=True,
              help="Processes to launch under torchrun (DDP/FSDP2).")
@config_option
@json_option
@quiet_option
@click.pass_context
@handle_errors
def command(ctx, nproc_per_node, config_file, as_json, quiet, **_):
    """Train the policy on rollout shards (or SFT on prompts), checkpoint and publish it.

    Recomputes old (and --ref) logprobs with the shards' sampling temperature, runs the optimizer
    steps, saves RUN/train/ckpt/step-NNNNNN (resumable) and publishes RUN/weights/weight_vNNNNNN,
    where NNNNNN is the policy version. Metrics go to train.jsonl with slime's names.

    Example:
      rltool train --rollouts run/rollouts/step-000001 --load models/tiny \\
          --save run/train/ckpt --publish run/weights --lr 1e-5 --global-batch-size 32
      rltool train --loss sft --prompts prompts.jsonl --load models/tiny --save sft/ckpt \\
          --publish sft/weights --lr 1e-3 --num-epochs 3
    """
    from rltool.config import resolve
    from rltool.train.config import TrainConfig
    from rltool.train.launch import launch, under_torchrun

    flags = explicit_flags(ctx)
    for name in ("nproc_per_node", "config_file", "as_json", "quiet"):
        flags.pop(name, None)
    cfg = resolve(TrainConfig, config_file=config_file, section="train", flags=flags)
    if nproc_per_node > 1 and not under_torchrun():
        from rltool.errors import EXIT_RUNTIME
        from rltool.train.stage import preflight

        preflight(cfg)  # bad input exits 2 here, not as a failed rank under torchrun
        extra = (["--json"] if as_json else []) + (["--quiet"] if quiet else [])
        code = launch(cfg, nproc_per_node=nproc_per_node, extra_args=extra)
        sys.exit(EXIT_RUNTIME if code else 0)  # torchrun reports a failed rank as 1
    from rltool.train import run
    from rltool.train.launch import is_rank_zero

    setup_logging(quiet=quiet or not is_rank_zero())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file loading bars drown the one-line messages
    result = run(cfg)
    if not is_rank_zero():
        return
    if as_json:
        echo_json(result.to_dict())
    else:
        click.echo(f"trained {result.optimizer_steps} step(s): policy version "
                   f"{result.policy_version}; checkpoint {result.checkpoint}; "
                   f"published {result.published}", err=True)
