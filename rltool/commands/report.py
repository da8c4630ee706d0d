import click

from rltool.commands.common import echo_json
from rltool.commands.options import build_config, command_options, stage_options
from rltool.loop.report import ReportConfig


@click.command("report")
@stage_options(ReportConfig, table="report")
@command_options("json")
def command(as_json, **_):
    """Plot a loop run's metrics (reward, response length, KL, logprob diff, step time by phase)
    into an HTML page and print a summary table.

    Example:
      rltool report runs/demo && xdg-open runs/demo/report/index.html
    """
    from rltool.atomic import check_output_path
    from rltool.errors import BadInputError
    from rltool.loop.report import write_report

    cfg = build_config(ReportConfig, table="report")
    if cfg.out and (check_output_path(cfg.out, flag="--out", directory=True)
                    / "index.html").exists():
        raise BadInputError(f"--out {cfg.out} already holds a report (index.html); choose a new "
                            "folder (an output is never replaced)")
    run_dir = cfg.run_dir
    result = write_report(run_dir, out=cfg.out)
    if as_json:
        echo_json(result)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rltool run {run_dir}")
    for column in ("metric", "first", "last", "best"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for row in result["summary"]:
        table.add_row(row["metric"], row["first"], row["last"], row["best"])
    Console().print(table)
    click.echo(f"report: {result['html']}", err=True)
