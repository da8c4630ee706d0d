import sys

import click

from rltool.commands.common import (config_option, echo_json, explicit_flags, handle_errors,
                                    json_option, setup_logging, split_dirs)

FLAGS = ["rollouts", "weights", "backend", "tol", "allow_version_mismatch", "dtype",
         "deterministic", "max_tokens_per_microbatch", "global_batch_size", "num_worst",
         "layerwise", "engine", "layerwise_samples", "layer_tol", "api_key", "timeout_s", "report"]


@click.command("align-gate")
@click.option("--rollouts", multiple=True, callback=split_dirs,
              help="Rollout shard directories (DIR[,DIR...]; repeatable).")
@click.option("--weights", default=None, help="Weights the rollouts were sampled with (HF dir "
              "weight_vNNNNNN or a trainer checkpoint).")
@click.option("--backend", type=click.Choice(["torch"]), default=None,
              help="Trainer backend that recomputes (default torch).")
@click.option("--tol", type=float, default=None,
              help="Pass when train_rollout_logprob_abs_diff <= TOL (default 1e-6).")
@click.option("--allow-version-mismatch", is_flag=True, default=None,
              help="Compare even if the weights' version differs from the shards' tokens.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="Where the trainer path recomputes (default cpu, like the builtin engine).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default=None,
              help="Trainer compute dtype, as in `rltool train` (default fp32).")
@click.option("--deterministic/--no-deterministic", default=None,
              help="Trainer's one-unpadded-pass-per-sample layout, as in `rltool train`.")
@click.option("--max-tokens-per-microbatch", type=int, default=None,
              help="Trainer micro-batch token cap, as in `rltool train` (default 4096).")
@click.option("--global-batch-size", type=int, default=None,
              help="Samples per optimizer step of the training run (default all).")
@click.option("--num-worst", type=int, default=None,
              help="Worst samples and token positions to report (default 5).")
@click.option("--layerwise", is_flag=True, default=None,
              help="Compare per-layer hidden states of the worst samples with --engine.")
@click.option("--engine", default=None, help="Engine URL for --layerwise (started with "
              "`rltool serve --enable-debug-endpoints`, same weights).")
@click.option("--layerwise-samples", type=int, default=None,
              help="How many worst samples --layerwise compares (default 1).")
@click.option("--layer-tol", type=float, default=None,
              help="Per-layer max |diff| tolerance (default: --tol).")
@click.option("--api-key", envvar="RLTOOL_API_KEY", default=None,
              help="Bearer token for --engine (env RLTOOL_API_KEY).")
@click.option("--timeout-s", type=float, default=None,
              help="Timeout of one engine debug request (default 120).")
@click.option("--report", type=click.Path(dir_okay=False), default=None,
              help="Also write the result JSON here (resolved config next to it).")
@config_option
@json_option
@handle_errors
def command(config_file, as_json, **_):
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
    from rltool.align.config import AlignGateConfig
    from rltool.align.gate import run
    from rltool.config import resolve

    ctx = click.get_current_context()
    cfg = resolve(AlignGateConfig, config_file=config_file, section="align",
                  flags=explicit_flags(ctx, FLAGS))
    setup_logging(quiet=as_json)
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
