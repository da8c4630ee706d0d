import sys

import click

from rltool.align.config import AlignGateConfig
from rltool.atomic import check_output_path
from rltool.commands.common import echo_json
from rltool.commands.options import build_config, command_options, stage_options


@click.command("align-gate")
@stage_options(AlignGateConfig, table="align")
@command_options("config", "json")
def command(as_json, **_):
    """Gate: do the trainer's recomputed logprobs match the rollout engine's?

    Recomputes every response token's logprob of the shards with the trainer path (its
    micro-batch schedule, dtype and layout) from --weights, and compares with the shards'
    rollout_logprobs on loss-masked tokens: train_rollout_logprob_abs_diff (per sample mean
    |train - rollout|, then the mean over samples), max |diff|, a histogram and the worst samples
    and positions. With --layerwise, also names the first layer whose hidden states differ
    between the engine and the trainer. Exit 0 when the metric <= --tol, 1 when not, 2 on bad
    input (missing or corrupt shards, tokenizer or version mismatch, missing weights).

    Example:

    \b
      rltool align-gate --rollouts runs/r1/rollouts/step-000000 \\
        --weights runs/r1/weights/weight_v000000 --deterministic --tol 0
      rltool align-gate --rollouts runs/r1/rollouts/step-000003 \\
        --weights runs/r1/weights/weight_v000003 --layerwise --engine http://127.0.0.1:30000
    """
    from rltool.align.gate import run

    cfg = build_config(AlignGateConfig, table="align")
    if cfg.report:
        check_output_path(cfg.report, flag="--report")
    result = run(cfg)
    if as_json:
        echo_json(result.to_dict())
    else:
        _print_human(result)
    sys.exit(result.exit_code)


def _print_human(result) -> None:
    verdict = "PASS" if result.passed else "FAIL"
    click.echo(f"{verdict}  train_rollout_logprob_abs_diff = {result.metric:.3e} "
               f"(tol {result.tol:g})  max |diff| = {result.max_abs_diff:.3e}  "
               f"{result.num_samples} samples, {result.num_masked_tokens} masked tokens, "
               f"recompute {result.recompute_s:.2f}s")
    click.echo("histogram of |diff| per token:")
    for b in result.histogram:
        if b["count"]:
            label = "0" if b["high"] == 0.0 else f"[{b['low']:.0e}, {b['high']:.0e})"
            click.echo(f"  {label:>18}  {b['count']}")
    if result.worst_samples and not result.max_abs_diff == 0.0:
        click.echo("worst samples:")
        for w in result.worst_samples:
            click.echo(f"  {w['uid']}  mean {w['mean_abs_diff']:.3e}  max {w['max_abs_diff']:.3e}"
                       f" at response token {w['max_position']}  ({w['shard']} row {w['row']})")
        click.echo("worst positions:")
        for p in result.worst_positions:
            click.echo(f"  {p['uid']}[{p['position']}] token {p['token_id']}: train "
                       f"{p['train_logprob']:.6f} rollout {p['rollout_logprob']:.6f} "
                       f"|diff| {p['abs_diff']:.3e}")
    if result.layerwise is not None:
        lw = result.layerwise
        click.echo(f"layerwise (engine weight_version {lw['engine_weight_version']}, samples "
                   f"{', '.join(lw['samples'])}, tol {lw['tol']:g}):")
        for layer in lw["layers"]:
            click.echo(f"  {layer['name']:>14}  max {layer['max_abs_diff']:.3e}  "
                       f"mean {layer['mean_abs_diff']:.3e}")
        first = lw["first_layer_above_tol"]
        click.echo(f"first layer above tol: {first}" if first else "no layer above tol")
