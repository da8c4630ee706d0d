import click

from rltool.commands.common import echo_json
from rltool.commands.options import build_config, command_options, stage_options
from rltool.rollout.eval import EvalConfig


@click.command("eval")
@stage_options(EvalConfig, table="eval")
@command_options("config", "json")
def command(as_json, **_):
    """Evaluate held-out prompts: K samples each, an eval shard and pass@k metrics.

    Writes --out (refused if it exists) and one line to eval.jsonl next to it (or --metrics):
    eval/mean_reward, eval/pass@1, eval/pass@k (k = --n-samples-per-prompt),
    eval/truncated_ratio. With --json the result, metrics included, goes to stdout.

    Example:

    \b
      rltool eval --engines http://127.0.0.1:30001 --prompts heldout.jsonl --reward reverse \\
        --n-samples-per-prompt 4 --max-response-len 32 --out runs/r1/eval/step-000010 --json
    """
    from rltool.rollout.eval import run

    result = run(build_config(EvalConfig, table="eval"))
    if as_json:
        echo_json(result)
        return
    m = result["metrics"]
    click.echo(f"eval of {m['eval/num_prompts']} prompts x {m['eval/k']}: mean reward "
               f"{m['eval/mean_reward']:.4f}, pass@1 {m['eval/pass@1']:.4f}, pass@{m['eval/k']} "
               f"{m['eval/pass@k']:.4f}, truncated {m['eval/truncated_ratio']:.2f} -> "
               f"{result['out']}", err=True)
