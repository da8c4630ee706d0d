import click

from rltool.commands.common import config_option, echo_json, handle_errors, json_option, quiet_option
from rltool.commands.rollout import engine_stage_options, resolve_and_run


@click.command("eval")
@engine_stage_options
@click.option("--max-prompts", type=int, default=None, help="Only the first N prompts.")
@click.option("--pass-threshold", type=float, default=None,
              help="Reward at or above which a sample passes (default 1.0).")
@config_option
@json_option
@quiet_option
@handle_errors
@click.pass_context
def command(ctx, config_file, as_json, quiet, **_):
    """Evaluate held-out prompts: K samples each, an eval shard and pass@k metrics.

    Writes --out (refused if it exists) and one line to eval.jsonl next to it (or --metrics):
    eval/mean_reward, eval/pass@1, eval/pass@k (k = --n-samples-per-prompt),
    eval/truncated_ratio. With --json the result, metrics included, goes to stdout.

    Example:

    \b
      rltool eval --engines http://127.0.0.1:30001 --prompts heldout.jsonl --reward reverse \\
        --n-samples-per-prompt 4 --max-response-len 32 --out runs/r1/eval/step-000010 --json
    """
    from rltool.rollout.eval import EvalConfig, run

    result = resolve_and_run(ctx, EvalConfig, run, section="eval", config_file=config_file,
                             quiet=quiet or as_json)
    if as_json:
        echo_json(result)
        return
    m = result["metrics"]
    click.echo(f"eval of {m['eval/num_prompts']} prompts x {m['eval/k']}: mean reward "
               f"{m['eval/mean_reward']:.4f}, pass@1 {m['eval/pass@1']:.4f}, pass@{m['eval/k']} "
               f"{m['eval/pass@k']:.4f}, truncated {m['eval/truncated_ratio']:.2f} -> "
               f"{result['out']}", err=True)
