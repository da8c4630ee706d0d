import click

from rltool.commands.common import echo_json, handle_errors, json_option


@click.group("data")
def command():
    """Prompt datasets for the built-in tasks."""


@command.command("make")
@click.option("--task", required=True, help="copy, reverse, sort or add.")
@click.option("--num", type=int, required=True, help="Number of prompts.")
@click.option("--seed", type=int, default=0, show_default=True, help="Generator seed.")
@click.option("--min-len", type=int, default=None, help="Shortest digit string (task default).")
@click.option("--max-len", type=int, default=None, help="Longest digit string (task default).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output .jsonl file.")
@json_option
@handle_errors
def make(task, num, seed, min_len, max_len, out, as_json):
    """Write NUM prompts of TASK as JSONL rows {prompt_id, prompt, label, metadata}.

    Example:
      rltool data make --task reverse --num 512 --seed 1 --out prompts.jsonl
    """
    from rltool.data.tasks import make_rows, write_prompts

    rows = make_rows(task, num=num, seed=seed, min_len=min_len, max_len=max_len)
    write_prompts(rows, out)
    if as_json:
        echo_json({"path": out, "rows": len(rows), "task": task})
    else:
        click.echo(f"wrote {len(rows)} {task} prompts to {out}", err=True)


@command.command("list")
@json_option
def list_tasks(as_json):
    """List the built-in tasks.

    Example:
      rltool data list --json
    """
    from rltool.data.tasks import TASKS

    if as_json:
        echo_json({n: t.description for n, t in TASKS.items()})
    else:
        for name, task in TASKS.items():
            click.echo(f"{name:10s} {task.description}")
