import click

from rltool.commands.common import echo_json
from rltool.commands.options import build_config, command_options, stage_options
from rltool.data.config import ShardsInspectConfig


@click.group("shards")
def command():
    """Inspect and validate rollout shards."""


@command.command("inspect")
@stage_options(ShardsInspectConfig, table="shards")
@command_options("json")
def inspect(as_json, **_):
    """Validate the shard at PATH and summarise it: rows, groups, rewards, lengths, statuses.

    Exit 2 with a one-line reason when the shard is malformed, or when --tokenizer is given and
    the shard was made with another tokenizer.

    \b
    Example:
      rltool shards inspect runs/r1/rollouts/step-000003 --json
      rltool shards inspect runs/r1/rollouts/step-000003 --tokenizer runs/r1/weights/weight_v000000
    """
    from rltool.data.shards import open_shard, shard_stats
    from rltool.data.tokenizer import tokenizer_hash

    cfg = build_config(ShardsInspectConfig, table="shards")
    expected = tokenizer_hash(cfg.tokenizer) if cfg.tokenizer is not None else None
    # shard_stats reads every row group, validating each in full
    stats = shard_stats(open_shard(cfg.path, expected_tokenizer_hash=expected))
    if as_json:
        echo_json(stats)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"shard {stats['path']}")
    table.add_column("field")
    table.add_column("value")
    rl = stats["response_len"]
    for key, value in [
        ("rows", stats["rows"]), ("groups", stats["groups"]), ("step", stats["step"]),
        ("reward mean ± std", f"{stats['reward_mean']:.4f} ± {stats['reward_std']:.4f}"),
        ("response len mean/min/p50/max",
         f"{rl['mean']:.1f} / {rl['min']} / {rl['p50']} / {rl['max']}"),
        ("status", ", ".join(f"{k}={v}" for k, v in sorted(stats["status_counts"].items()))),
        ("weight versions", f"{stats['weight_version_min']}..{stats['weight_version_max']}"),
        ("tokenizer hash", stats["tokenizer_hash"]), ("sampling", str(stats["sampling"])),
    ]:
        table.add_row(key, str(value))
    Console().print(table)
