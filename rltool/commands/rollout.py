import click

from rltool.commands.common import (config_option, echo_json, explicit_flags, handle_errors,
                                    json_option, quiet_option, setup_logging)


def engine_stage_options(fn):
    """Options rollout and eval share (fields of rltool.rollout.stage.EngineStageConfig)."""
    options = [
        click.option("--engines", default=None, help="Engine URLs, comma-separated (rltool "
                     "balances: least outstanding, sessions by consistent hashing)."),
        click.option("--router", default=None, help="Gateway URL (smg) instead of --engines."),
        click.option("--prompts", type=click.Path(dir_okay=False), default=None,
                     help="Prompt file, .jsonl or .parquet."),
        click.option("--out", type=click.Path(file_okay=False), default=None,
                     help="Shard directory to create (refused if it exists)."),
        click.option("--n-samples-per-prompt", type=int, default=None,
                     help="Samples per prompt (group size)."),
        click.option("--max-response-len", type=int, default=None,
                     help="Most response tokens per sample."),
        click.option("--temperature", type=float, default=None, help="Default 1.0."),
        click.option("--top-p", type=float, default=None, help="Default 1.0."),
        click.option("--top-k", type=int, default=None, help="Default -1 (off)."),
        click.option("--reward", default=None, help="Task name, module:function or http(s) URL."),
        click.option("--tokenizer", type=click.Path(file_okay=False), default=None,
                     help="Tokenizer dir (default: the engine's tokenizer_path)."),
        click.option("--concurrency", type=int, default=None,
                     help="Most in-flight requests per engine (default 32)."),
        click.option("--step", type=int, default=None, help="Step number (default 0)."),
        click.option("--seed", type=int, default=None, help="Base sampling seed."),
        click.option("--generate-fn", default=None,
                     help="Custom async generate function module:function, e.g. "
                     "rltool.rollout.calculator:generate."),
        click.option("--metrics", type=click.Path(dir_okay=False), default=None,
                     help="Metrics JSONL (default: next to --out)."),
        click.option("--api-key", envvar="RLTOOL_API_KEY", default=None,
                     help="Bearer token for the engines (env RLTOOL_API_KEY)."),
        click.option("--reward-timeout-s", type=float, default=None,
                     help="Timeout of one reward call (default 30)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def resolve_and_run(ctx, model, run, *, section, config_file, quiet):
    """rollout and eval: logging, config (file table + explicit flags), then the library call."""
    import logging

    from rltool.config import resolve

    setup_logging(quiet=quiet)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request
    flags = {k: v for k, v in explicit_flags(ctx).items() if k not in ("as_json", "config_file")}
    return run(resolve(model, config_file=config_file, section=section, flags=flags))


@click.command("rollout")
@engine_stage_options
@click.option("--rollout-batch-size", type=int, default=None,
              help="Prompts per step; step K takes prompts [K*P, (K+1)*P), cycling.")
@click.option("--filter", "filter", type=click.Choice(["none", "all-equal-reward"]), default=None,
              help="all-equal-reward: DAPO dynamic sampling with over-sampling.")
@click.option("--over-sample-factor", type=float, default=None,
              help="With --filter, start this many times the batch at once (default 1.0).")
@click.option("--max-prompts", type=int, default=None,
              help="With --filter, most prompts to start (default 4 x batch).")
@click.option("--partial", is_flag=True, default=None,
              help="Carry aborted samples (with their tokens) to the next step.")
@click.option("--max-failed-rewards-frac", type=float, default=None,
              help="Exit 3, writing nothing, when more than this share of the reward calls "
                   "failed (raised or timed out) (default 0.05).")
@config_option
@json_option
@quiet_option
@handle_errors
@click.pass_context
def command(ctx, config_file, as_json, quiet, **_):
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
    from rltool.rollout.stage import RolloutConfig, run

    result = resolve_and_run(ctx, RolloutConfig, run, section="rollout", config_file=config_file,
                             quiet=quiet)
    if as_json:
        echo_json(result)
        return
    m = result["metrics"]
    click.echo(f"wrote {result['rows']} samples in {result['groups']} groups to {result['out']}: "
               f"reward {m['rollout/raw_reward']:.4f}, response len "
               f"{m['rollout/response_len/mean']:.1f}, truncated {m['rollout/truncated_ratio']:.2f}, "
               f"{m['perf/tokens_per_sec']:.1f} tok/s", err=True)
