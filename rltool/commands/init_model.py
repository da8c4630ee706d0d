import click

from rltool.commands.common import echo_json
from rltool.commands.options import build_config, command_options, stage_options
from rltool.data.models import InitModelConfig


@click.command("init-model")
@stage_options(InitModelConfig, table="init_model")
@command_options("config", "json")
def command(as_json, **_):
    """Write a random-init HF checkpoint (safetensors) with an offline character tokenizer.

    \b
    Example:
      rltool init-model --arch qwen2 --preset tiny --task reverse --out models/tiny
    """
    from rltool.data.models import init_model

    cfg = build_config(InitModelConfig, table="init_model")
    path = init_model(cfg.out, arch=cfg.arch, preset=cfg.preset, task=cfg.task, seed=cfg.seed,
                      dtype=cfg.dtype, device=cfg.device)
    result = {"path": str(path), "arch": cfg.arch, "preset": cfg.preset, "task": cfg.task}
    if as_json:
        echo_json(result)
    else:
        click.echo(f"wrote {cfg.arch}/{cfg.preset} model to {path}", err=True)
