import click

from rltool.commands.common import echo_json
from rltool.commands.options import command_options


@click.command("profile")
@click.argument("run_dir", type=click.Path(exists=True))
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Where to write the Chrome/Perfetto trace "
                   "(default RUN/profile/chrome_trace.json).")
@click.option("--torch-profiler", "torch_steps", default=None,
              help="Loop steps (e.g. 2,3) whose torch.profiler kernel traces to summarize; capture "
                   "them by running the loop with RLTOOL_TORCH_PROFILE_STEPS=2,3.")
@command_options("json")
def command(run_dir, out, torch_steps, as_json):
    """Phase table, wait ratios and async speedup of a traced run, and its Chrome trace.

    RUN_DIR is a loop run directory (its trace/ folder) or a folder of trace JSONL files.

    Example:
      rltool profile runs/demo && open ui.perfetto.dev with runs/demo/profile/chrome_trace.json
    """
    from rltool.atomic import check_output_path
    from rltool.errors import BadInputError
    from rltool.profile.stage import profile_run

    if out:
        check_output_path(out, flag="--out", new=True)
    steps = None
    if torch_steps:
        try:
            steps = [int(s) for s in torch_steps.split(",") if s.strip()]
        except ValueError:
            raise BadInputError(f"--torch-profiler {torch_steps!r}: expected step numbers like "
                                "2,3") from None
    result = profile_run(run_dir, out=out, torch_steps=steps)
    if as_json:
        echo_json(result)
        return
    from rltool.commands.tables import print_profile

    print_profile(result)
