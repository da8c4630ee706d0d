import click

from rltool.commands.common import (echo_json, handle_errors, json_option, quiet_option,
                                    setup_logging)

# Flags that override a [loop] / [sync] key of the config file.
LOOP_FLAGS = ("num_steps", "placement", "num_engines", "eval_interval", "align_gate",
              "deterministic", "seed")


@click.command("loop")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="Loop TOML: [model], [rollout], [train], [sync], [eval], [loop] tables.")
@click.option("--run-dir", default=None, type=click.Path(file_okay=False),
              help="New run directory to create (default: run).")
@click.option("--resume", "resume_dir", default=None, type=click.Path(file_okay=False),
              help="Continue the run in this directory from its state.json.")
@click.option("--num-steps", type=int, default=None, help="Loop steps ([loop] num_steps).")
@click.option("--placement", type=click.Choice(["colocated", "disaggregated"]), default=None,
              help="colocated: engines release memory while training; disaggregated: trainer "
              "subprocess beside live engines.")
@click.option("--num-engines", type=int, default=None, help="Builtin engines to start.")
@click.option("--sync", "sync_mode",
              type=click.Choice(["full", "delta", "auto", "tensor", "distributed"]), default=None,
              help="Weight sync: full checkpoints or deltas on disk, tensor (shared memory) or "
              "distributed (gloo broadcast) in memory, or auto (tensor when colocated, else the "
              "cost model).")
@click.option("--save-interval", type=int, default=None,
              help="Colocated: checkpoint every K steps and at the end ([loop] save_interval).")
@click.option("--eval-interval", type=int, default=None, help="Evaluate every K steps.")
@click.option("--align-gate", type=float, default=None,
              help="Stop (exit 1) when train/train_rollout_logprob_abs_diff exceeds TOL.")
@click.option("--deterministic/--no-deterministic", default=None,
              help="Deterministic engines and trainer, fixed seeds (resume reproduces weights).")
@click.option("--seed", type=int, default=None, help="Rollout/trainer seed ([loop] seed).")
@click.option("--set", "sets", multiple=True, metavar="TABLE.KEY=VALUE",
              help="Override any key of the config, e.g. --set train.lr=3e-3 (repeatable).")
@json_option
@quiet_option
@handle_errors
def command(config_file, run_dir, resume_dir, sync_mode, sets, as_json, quiet, **loop_flags):
    """Run the synchronous RL loop: rollout -> train -> publish -> engines load -> metrics.

    A new run needs --config; `--resume RUN` continues a killed run (ending orphaned engines
    first). Writes RUN/state.json, engines.json, weights/, rollouts/, train/, eval/, metrics/
    (loop.jsonl: one line per step). See docs/loop.md.

    Example:
      rltool loop --config examples/demo.toml --run-dir runs/demo --num-steps 20
      rltool loop --resume runs/demo
    """
    from rltool.errors import BadInputError
    from rltool.loop import runner
    from rltool.loop.config import LoopSettings, parse_set_options

    setup_logging(quiet=quiet)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per step drowns the step lines
    _signals_as_interrupt()
    overrides = parse_set_options(sets)
    loop_values = {k: v for k, v in loop_flags.items() if v is not None}
    if loop_values:
        overrides.setdefault("loop", {}).update(loop_values)
    if sync_mode is not None:
        overrides.setdefault("sync", {})["sync"] = sync_mode
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
