import sys

import click

from rltool.commands.common import echo_json
from rltool.commands.options import build_config, command_options, stage_options, verbosity
from rltool.train.config import TrainConfig


@click.command("train")
@stage_options(TrainConfig, table="train")
@command_options("config", "json", "nproc_per_node")
def command(nproc_per_node, as_json, **_):
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
    from rltool.train.launch import launch, under_torchrun

    cfg = build_config(TrainConfig, table="train")
    if nproc_per_node > 1 and not under_torchrun():
        from rltool.errors import EXIT_RUNTIME
        from rltool.train.stage import preflight

        # bad input exits 2 here, not as a failed rank under torchrun; the ranks take the
        # recompute and micro-batch cap planned here
        cfg = preflight(cfg, world_size=nproc_per_node).cfg
        extra = (["--json"] if as_json else []) + {-1: ["--quiet"], 0: [], 1: ["--verbose"]}[
            verbosity()]
        code = launch(cfg, nproc_per_node=nproc_per_node, extra_args=extra)
        sys.exit(EXIT_RUNTIME if code else 0)  # torchrun reports a failed rank as 1
    from rltool.train import run
    from rltool.train.launch import is_rank_zero

    result = run(cfg)
    if not is_rank_zero():
        return
    if as_json:
        echo_json(result.to_dict())
    else:
        click.echo(f"trained {result.optimizer_steps} step(s): policy version "
                   f"{result.policy_version}; checkpoint {result.checkpoint}; "
                   f"published {result.published}", err=True)
