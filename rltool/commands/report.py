import click

from rltool.commands.common import echo_json, handle_errors, json_option


@click.command("report")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Folder for index.html and the PNGs (default RUN/report).")
@json_option
@handle_errors
def command(run_dir, out, as_json):
    """Plot a loop run's metrics (reward, response length, KL, logprob diff, step time by phase)
    into an HTML page and print a summary table.

    Example:
      rltool report runs/demo && xdg-open runs/demo/report/index.html
    """
    from rltool.loop.report import write_report

    result = write_report(run_dir, out=out)
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
