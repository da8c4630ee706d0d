import click

from rltool.commands.common import echo_json, handle_errors, json_option


@click.command("init-model")
@click.option("--arch", type=click.Choice(["qwen2", "qwen3", "llama", "qwen3_moe"]), default="qwen2",
              show_default=True, help="HF architecture.")
@click.option("--preset", default="tiny", show_default=True,
              help="Model size: tiny, small, or qwen2.5-0.5b (Qwen2.5-0.5B's shapes).")
@click.option("--task", default=None, help="Built-in task the model is for (recorded in config.json).")
@click.option("--seed", type=int, default=0, show_default=True, help="Init seed.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True, help="Weight dtype.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="New directory.")
@json_option
@handle_errors
def command(arch, preset, task, seed, dtype, out, as_json):
    """Write a random-init HF checkpoint (safetensors) with an offline character tokenizer.

    Example:
      rltool init-model --arch qwen2 --preset tiny --task reverse --out models/tiny
    """
    from rltool.data.models import init_model

    path = init_model(out, arch=arch, preset=preset, task=task, seed=seed, dtype=dtype)
    result = {"path": str(path), "arch": arch, "preset": preset, "task": task}
    if as_json:
        echo_json(result)
    else:
        click.echo(f"wrote {arch}/{preset} model to {path}", err=True)
