import click

from rltool.commands.common import (config_option, echo_json, explicit_flags, handle_errors,
                                    json_option)


@click.group("delta")
def command():
    """Delta weight versions: encode, apply, verify, pull (rltool's format and slime's)."""


def _report(result: dict, as_json: bool, summary: str) -> None:
    if as_json:
        echo_json(result)
    else:
        click.echo(summary, err=True)


@command.command("diff")
@click.option("--base", type=click.Path(file_okay=False), help="Full checkpoint to diff against.")
@click.option("--new", type=click.Path(file_okay=False), help="Full checkpoint to encode.")
@click.option("--out", type=click.Path(file_okay=False), help="New delta directory.")
@click.option("--format", "format", type=click.Choice(["rltool", "slime"]), default="rltool",
              show_default=True, help="rltool (smaller) or slime (slime-patched SGLang reads it).")
@click.option("--encoding", type=click.Choice(["xor", "overwrite"]), default="xor",
              show_default=True, help="slime format: encoding of every tensor.")
@click.option("--workers", type=int, default=None, help="Encoder threads [default: CPUs, <= 8].")
@click.option("--version", "version", type=int, default=None,
              help="Version of --new [default: its rltool_version.json or name].")
@click.option("--base-version", type=int, default=None,
              help="Version of --base [default: its rltool_version.json or name].")
@config_option
@json_option
@click.pass_context
@handle_errors
def diff(ctx, base, new, out, format, encoding, workers, version, base_version, config_file,
         as_json):
    """Write the delta that turns checkpoint --base into --new (changed tensors only).

    \b
    Example:
      rltool delta diff --base runs/r1/weights/weight_v000003 \\
          --new runs/r1/train/out_v4 --out runs/r1/weights/weight_v000004 --json
    """
    from rltool.config import resolve
    from rltool.io.checkpoint import open_checkpoint
    from rltool.rundir import declared_version
    from rltool.delta.config import DiffConfig
    from rltool.delta.diff import write_delta
    from rltool.errors import BadInputError

    cfg = resolve(DiffConfig, config_file=config_file, section="delta",
                  flags=explicit_flags(ctx, ["base", "new", "out", "format", "encoding", "workers",
                                             "version", "base_version"]) | {
                      "base": base, "new": new, "out": out})
    base_ckpt, new_ckpt = open_checkpoint(cfg.base), open_checkpoint(cfg.new)
    v_base = cfg.base_version if cfg.base_version is not None else declared_version(cfg.base)
    v_new = cfg.version if cfg.version is not None else declared_version(cfg.new)
    if v_base is None or v_new is None:
        raise BadInputError("cannot tell the versions of --base/--new (no rltool_version.json, "
                            "not named weight_vNNNNNN); pass --base-version and --version")
    if v_new <= v_base:
        raise BadInputError(f"--version {v_new} must be greater than --base-version {v_base}")
    stats = write_delta(base_ckpt, new_ckpt, cfg.out, version=v_new, base_version=v_base,
                        fmt=cfg.format, encoding=cfg.encoding, workers=cfg.workers)
    _report(stats, as_json, f"wrote {cfg.out}: {stats['tensors_changed']}/{stats['tensors_total']}"
            f" tensors changed, density {stats['density']:.4%}, {stats['wire_bytes']} bytes "
            f"({stats['wire_bytes'] / max(stats['full_bytes'], 1):.2%} of full) in "
            f"{stats['encode_s']:.2f}s")


@command.command("apply")
@click.option("--base", required=True, type=click.Path(file_okay=False),
              help="Full checkpoint the delta applies on.")
@click.option("--delta", "deltas", required=True, multiple=True, type=click.Path(file_okay=False),
              help="Delta directory; repeat for a chain, oldest first.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="New directory.")
@click.option("--workers", type=int, default=None, help="Decoder threads [default: CPUs, <= 8].")
@json_option
@handle_errors
def apply(base, deltas, out, workers, as_json):
    """Rebuild the full checkpoint --base + --delta(s) in --out, verifying every checksum.

    Exit 2 (and --out is not created) on a wrong base, a broken chain or a checksum mismatch.

    \b
    Example:
      rltool delta apply --base models/tiny --delta weights/weight_v000001 --out /tmp/v1
    """
    from rltool.delta.apply import apply_chain
    from rltool.io.checkpoint import open_checkpoint
    from rltool.rundir import declared_version
    from rltool.delta.deltadir import open_delta

    chain = [open_delta(d) for d in deltas]
    stats = apply_chain(open_checkpoint(base), chain, out, base_version=declared_version(base),
                        workers=workers)
    _report(stats | {"out": out}, as_json, f"wrote {out} (version {stats['version']}): "
            f"{stats['tensors_changed']} tensors changed in {stats['decode_s']:.2f}s")


@command.command("verify")
@click.argument("path", type=click.Path())
@click.option("--base", type=click.Path(file_okay=False), default=None,
              help="For a delta: rebuild it on this checkpoint in memory and check every checksum.")
@click.option("--workers", type=int, default=None, help="Threads [default: CPUs, <= 8].")
@json_option
@handle_errors
def verify(path, base, workers, as_json):
    """Check a delta (structure, every blob decodes; with --base every checksum) or a full
    checkpoint (headers, offsets, sizes). Exit 1 when a check fails, 2 on unusable input.

    \b
    Example:
      rltool delta verify runs/r1/weights/weight_v000004 --base runs/r1/weights/weight_v000003
    """
    import sys

    from rltool.delta.verify import verify_dir

    result = verify_dir(path, base=base, workers=workers)
    status = "ok" if result["ok"] else "FAILED: " + "; ".join(result["problems"])
    _report(result, as_json, f"{path} ({result['kind']}): {status}")
    if not result["ok"]:
        from rltool.errors import EXIT_CHECK_FAILED

        sys.exit(EXIT_CHECK_FAILED)


@command.command("pull")
@click.option("--local", "local", required=True, type=click.Path(file_okay=False),
              help="Host-local checkpoint directory to bring up to date.")
@click.option("--source", required=True, type=click.Path(file_okay=False),
              help="Directory holding weight_vNNNNNN versions (full or delta).")
@click.option("--version", "version", required=True, type=int, help="Target version.")
@click.option("--base-model", type=click.Path(file_okay=False), default=None,
              help="Version 0 when --source has no weight_v000000.")
@click.option("--workers", type=int, default=None, help="Decoder threads [default: CPUs, <= 8].")
@json_option
@handle_errors
def pull(local, source, version, base_model, workers, as_json):
    """Make --local hold --version, as an engine's /pull_weights does (locked, verified, no-op
    when already there).

    \b
    Example:
      rltool delta pull --local /tmp/engine0 --source runs/r1/weights --version 4 \\
          --base-model models/tiny
    """
    from rltool.delta.pull import pull_weights

    result = pull_weights(local_checkpoint_dir=local, source_dir=source, target_version=version,
                          base_model_path=base_model, workers=workers)
    _report(result, as_json, f"{local} now holds version {result['version']}"
            + ("" if result["changed"] else " (already there)"))
