import click

from rltool.commands.common import echo_json
from rltool.commands.options import build_config, command_options, stage_options
from rltool.data.tasks import DataMakeConfig


@click.group("data")
def command():
    """Prompt datasets for the built-in tasks."""


@command.command("make")
@stage_options(DataMakeConfig, table="data")
@command_options("config", "json")
def make(as_json, **_):
    """Write --num prompts of --task as JSONL rows {prompt_id, prompt, label, metadata}.

    \b
    Example:
      rltool data make --task reverse --num 512 --seed 1 --out prompts.jsonl
      rltool data make --task add --num 3 --out - | jq -r .prompt
    """
    from rltool.atomic import check_output_path
    from rltool.data.tasks import make_rows, prompts_jsonl, write_prompts
    from rltool.errors import BadInputError

    cfg = build_config(DataMakeConfig, table="data")
    if cfg.out == "-" and as_json:
        raise BadInputError("--out - and --json both write to stdout; drop one of them")
    if cfg.out != "-":
        check_output_path(cfg.out, flag="--out", new=True)
    rows = make_rows(cfg.task, num=cfg.num, seed=cfg.seed, min_len=cfg.min_len,
                     max_len=cfg.max_len)
    if cfg.out == "-":
        click.echo(prompts_jsonl(rows), nl=False)
        return
    write_prompts(rows, cfg.out)
    if as_json:
        echo_json({"path": cfg.out, "rows": len(rows), "task": cfg.task})
    else:
        click.echo(f"wrote {len(rows)} {cfg.task} prompts to {cfg.out}", err=True)


@command.command("list")
@command_options("json")
def list_tasks(as_json):
    """List the built-in tasks.

    \b
    Example:
      rltool data list --json
    """
    from rltool.data.tasks import TASKS

    if as_json:
        echo_json({n: t.description for n, t in TASKS.items()})
    else:
        for name, task in TASKS.items():
            click.echo(f"{name:10s} {task.description}")
