import click

from rltool.commands.common import echo_json
from rltool.commands.options import build_config, command_options, stage_options
from rltool.rollout.stage import RolloutConfig


@click.command("rollout")
@stage_options(RolloutConfig, table="rollout")
@command_options("config", "json")
def command(as_json, **_):
    """Sample groups of responses for one step's prompts and write one Parquet shard.

    Step K takes the prompts at positions [K*P, (K+1)*P) of --prompts (cycling), samples
    --n-samples-per-prompt responses for each through the engines, rewards them in worker threads
    and writes --out (refused if it exists) plus a metrics line (rollout.jsonl next to --out).
    Exit 2 on bad input (nothing written), 3 when the engines fail or more than
    --max-failed-rewards-frac of the reward calls failed (nothing written).

    Example:

    \b
      rltool rollout --engines http://127.0.0.1:30001,http://127.0.0.1:30002 \\
        --prompts prompts.jsonl --out runs/r1/rollouts/step-000000 --reward reverse \\
        --n-samples-per-prompt 8 --rollout-batch-size 16 --max-response-len 32
    """
    from rltool.rollout.stage import run

    result = run(build_config(RolloutConfig, table="rollout"))
    if as_json:
        echo_json(result)
        return
    m = result["metrics"]
    click.echo(f"wrote {result['rows']} samples in {result['groups']} groups to {result['out']}: "
               f"reward {m['rollout/raw_reward']:.4f}, response len "
               f"{m['rollout/response_len/mean']:.1f}, truncated {m['rollout/truncated_ratio']:.2f}, "
               f"{m['perf/tokens_per_sec']:.1f} tok/s", err=True)
