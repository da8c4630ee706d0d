import click

from rltool.commands.common import echo_json
from rltool.commands.options import command_options, given, is_quiet, stage_options
from rltool.delta.config import SyncConfig
from rltool.loop.config import LoopConfig

# The loop config tables that have options; every other key goes through --set TABLE.KEY=VALUE.
OPTION_TABLES = ("loop", "sync")


@click.command("loop")
@stage_options(LoopConfig, table="loop")
@stage_options(SyncConfig, table="sync")
@command_options("config", "run_dir", "resume", "set", "json")
def command(config_file, run_dir, resume_dir, sets, as_json, **_):
    """Run the RL loop: rollout -> train -> publish -> engines load -> metrics, in turns
    (--mode sync) or overlapped (--mode async: continuous rollout, in-flight weight updates,
    bounded staleness).

    A new run needs --config (a loop TOML: [model], [rollout], [train], [sync], [eval] and [loop]
    tables); the options override its [loop] and [sync] keys, --set any key. `--resume RUN`
    continues a killed run (ending orphaned engines first). Writes RUN/state.json, engines.json,
    weights/, rollouts/, train/, eval/, metrics/ (loop.jsonl: one line per step). See
    docs/loop.md.

    Example:
      rltool loop --config examples/demo.toml --run-dir runs/demo --num-steps 20
      rltool loop --resume runs/demo
    """
    from rltool.errors import BadInputError
    from rltool.loop import runner
    from rltool.loop.config import LoopSettings, parse_set_options

    _signals_as_interrupt()
    ctx = click.get_current_context()
    overrides = parse_set_options(sets)
    for table in OPTION_TABLES:
        if values := given(ctx, table):
            overrides.setdefault(table, {}).update(values)
    quiet = is_quiet(ctx)
    on_step = None if (quiet or as_json) else _print_row
    if resume_dir is not None:
        if config_file is not None or run_dir is not None:
            raise BadInputError("--resume RUN takes the run's own config.toml; drop --config and "
                                "--run-dir")
        result = runner.resume(resume_dir, overrides=overrides or None, on_step=on_step)
    else:
        if config_file is None:
            raise BadInputError("a new run needs --config FILE.toml (or --resume RUN)")
        settings = LoopSettings.from_file(config_file, overrides=overrides)
        result = runner.start(settings, run_dir or "run", on_step=on_step)
    if as_json:
        echo_json(result)
    elif not quiet:
        click.echo(f"done: {result['steps']} steps, policy version {result['policy_version']}, "
                   f"{result['elapsed_s']:.1f}s; metrics {result['metrics']}", err=True)


def _print_row(row):
    def fmt(key, spec):
        value = row.get(key)
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    click.echo(f"step {row['step']:4d}  v{row['policy_version']:<4d} "
               f"reward {fmt('rollout/raw_reward', '.3f')}  "
               f"len {fmt('rollout/response_len/mean', '.1f')}  "
               f"|dlogp| {fmt('train/train_rollout_logprob_abs_diff', '.2e')}  "
               f"eval {fmt('eval/mean_reward', '.3f')}  "
               f"time {fmt('perf/loop/step_time', '.1f')}s", err=True)


def _signals_as_interrupt():
    """SIGINT and SIGTERM raise KeyboardInterrupt wherever the loop is, so its `finally` ends the
    engines by PID. An explicit SIGINT handler also keeps asyncio.run from installing its own,
    which only cancels the running task: a stage that absorbs the cancellation would let the
    loop carry on after Ctrl-C (seen in a test run)."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
