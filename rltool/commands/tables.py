"""Rich tables for `rltool profile` and `rltool plan` (the JSON forms carry the same numbers)."""

from __future__ import annotations

from typing import Any

import click


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(_fmt(row.get(c, "")) for c in columns))
    Console().print(table)


def print_profile(result: dict[str, Any]) -> None:
    print_rows("phases per step (seconds)", result["steps"])
    print_rows("wait ratio per resource",
               [{"resource": k, **v} for k, v in result["wait_ratios"].items()])
    if result["engines"]:
        print_rows("engines", [{"engine": k, **v} for k, v in result["engines"].items()])
    print_rows("async speedup (measured vs predicted bound)", [result["async"]])
    for step, kernels in result.get("kernel_traces", {}).items():
        print_rows(f"step {step}: top operations (torch.profiler)", kernels["top_ops"])
    click.echo(f"chrome trace: {result['chrome_trace']}", err=True)


def print_plan(result: dict[str, Any]) -> None:
    for model in result["models"]:
        print_rows(f"{model['model']}  (inputs: "
                   + ", ".join(f"{k}={_fmt(v)}" for k, v in model["inputs"].items()) + ")",
                   model["rows"])
        for note in model.get("notes", []):
            click.echo(f"  note: {note}")
