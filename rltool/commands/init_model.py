import click

from rltool.commands.common import (config_option, echo_json, explicit_flags, handle_errors,
                                    json_option)


@click.command("init-model")
@click.option("--arch", type=click.Choice(["qwen2", "qwen3", "llama", "qwen3_moe"]), default=None,
              help="HF architecture (default qwen2).")
@click.option("--preset", default=None,
              help="Model size: tiny (default), small, or qwen2.5-0.5b (Qwen2.5-0.5B's shapes).")
@click.option("--task", default=None, help="Built-in task the model is for (recorded in config.json).")
@click.option("--seed", type=int, default=None, help="Init seed (default 0).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=None,
              help="Weight dtype (default float32).")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="New directory.")
@config_option
@json_option
@click.pass_context
@handle_errors
def command(ctx, arch, preset, task, seed, dtype, out, config_file, as_json):
    """Write a random-init HF checkpoint (safetensors) with an offline character tokenizer.

    \b
    Example:
      rltool init-model --arch qwen2 --preset tiny --task reverse --out models/tiny
    """
    from rltool.config import resolve
    from rltool.data.models import InitModelConfig, init_model

    cfg = resolve(InitModelConfig, config_file=config_file, section="init_model",
                  flags=explicit_flags(ctx, list(InitModelConfig.model_fields)))
    path = init_model(cfg.out, arch=cfg.arch, preset=cfg.preset, task=cfg.task, seed=cfg.seed,
                      dtype=cfg.dtype)
    result = {"path": str(path), "arch": cfg.arch, "preset": cfg.preset, "task": cfg.task}
    if as_json:
        echo_json(result)
    else:
        click.echo(f"wrote {cfg.arch}/{cfg.preset} model to {path}", err=True)
