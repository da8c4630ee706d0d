import click

from rltool.commands.common import (config_option, echo_json, explicit_flags, handle_errors,
                                    json_option)


@click.group("data")
def command():
    """Prompt datasets for the built-in tasks."""


@command.command("make")
@click.option("--task", default=None, help="copy, reverse, sort or add (`rltool data list`).")
@click.option("--num", type=int, default=None, help="Number of prompts.")
@click.option("--seed", type=int, default=None, help="Generator seed (default 0).")
@click.option("--min-len", type=int, default=None, help="Shortest digit string (task default).")
@click.option("--max-len", type=int, default=None, help="Longest digit string (task default).")
@click.option("--out", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Output .jsonl file, or - for stdout.")
@config_option
@json_option
@click.pass_context
@handle_errors
def make(ctx, task, num, seed, min_len, max_len, out, config_file, as_json):
    """Write NUM prompts of TASK as JSONL rows {prompt_id, prompt, label, metadata}.

    \b
    Example:
      rltool data make --task reverse --num 512 --seed 1 --out prompts.jsonl
      rltool data make --task add --num 3 --out - | jq -r .prompt
    """
    from rltool.config import resolve
    from rltool.data.tasks import DataMakeConfig, make_rows, prompts_jsonl, write_prompts
    from rltool.errors import BadInputError

    cfg = resolve(DataMakeConfig, config_file=config_file, section="data",
                  flags=explicit_flags(ctx, list(DataMakeConfig.model_fields)))
    if cfg.out == "-" and as_json:
        raise BadInputError("--out - and --json both write to stdout; drop one of them")
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
@json_option
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
