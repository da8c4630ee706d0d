import click

from rltool.commands.common import echo_json
from rltool.commands.options import build_config, command_options, stage_options
from rltool.delta.config import ApplyConfig, DiffConfig, PullConfig, VerifyConfig

TABLE = "delta"


@click.group("delta")
def command():
    """Delta weight versions: encode, apply, verify, pull (rltool's format and slime's)."""


def _report(result: dict, as_json: bool, summary: str) -> None:
    if as_json:
        echo_json(result)
    else:
        click.echo(summary, err=True)


@command.command("diff")
@stage_options(DiffConfig, table=TABLE)
@command_options("config", "json")
def diff(as_json, **_):
    """Write the delta that turns checkpoint --base into --new (changed tensors only).

    \b
    Example:
      rltool delta diff --base runs/r1/weights/weight_v000003 \\
          --new runs/r1/train/out_v4 --out runs/r1/weights/weight_v000004 --json
    """
    from rltool.io.checkpoint import open_checkpoint
    from rltool.delta.diff import write_delta
    from rltool.errors import BadInputError
    from rltool.rundir import declared_version

    cfg = build_config(DiffConfig, table=TABLE)
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
@stage_options(ApplyConfig, table=TABLE)
@command_options("config", "json")
def apply(as_json, **_):
    """Rebuild the full checkpoint --base + --delta(s) in --out, verifying every checksum.

    Exit 2 (and --out is not created) on a wrong base, a broken chain or a checksum mismatch.

    \b
    Example:
      rltool delta apply --base models/tiny --delta weights/weight_v000001 --out /tmp/v1
    """
    from rltool.delta.apply import apply_chain
    from rltool.io.checkpoint import open_checkpoint
    from rltool.delta.deltadir import open_delta
    from rltool.rundir import declared_version

    cfg = build_config(ApplyConfig, table=TABLE)
    chain = [open_delta(d) for d in cfg.delta]
    stats = apply_chain(open_checkpoint(cfg.base), chain, cfg.out,
                        base_version=declared_version(cfg.base), workers=cfg.workers)
    _report(stats | {"out": cfg.out}, as_json, f"wrote {cfg.out} (version {stats['version']}): "
            f"{stats['tensors_changed']} tensors changed in {stats['decode_s']:.2f}s")


@command.command("verify")
@stage_options(VerifyConfig, table=TABLE)
@command_options("config", "json")
def verify(as_json, **_):
    """Check a delta (structure, every blob decodes; with --base every checksum) or a full
    checkpoint (headers, offsets, sizes). Exit 1 when a check fails, 2 on unusable input.

    \b
    Example:
      rltool delta verify runs/r1/weights/weight_v000004 --base runs/r1/weights/weight_v000003
    """
    import sys

    from rltool.delta.verify import verify_dir

    cfg = build_config(VerifyConfig, table=TABLE)
    result = verify_dir(cfg.path, base=cfg.base, workers=cfg.workers)
    status = "ok" if result["ok"] else "FAILED: " + "; ".join(result["problems"])
    _report(result, as_json, f"{cfg.path} ({result['kind']}): {status}")
    if not result["ok"]:
        from rltool.errors import EXIT_CHECK_FAILED

        sys.exit(EXIT_CHECK_FAILED)


@command.command("pull")
@stage_options(PullConfig, table=TABLE)
@command_options("config", "json")
def pull(as_json, **_):
    """Make --local hold --version, as an engine's /pull_weights does (locked, verified, no-op
    when already there).

    \b
    Example:
      rltool delta pull --local /tmp/engine0 --source runs/r1/weights --version 4 \\
          --base-model models/tiny
    """
    from rltool.delta.pull import pull_weights

    cfg = build_config(PullConfig, table=TABLE)
    result = pull_weights(local_checkpoint_dir=cfg.local, source_dir=cfg.source,
                          target_version=cfg.version, base_model_path=cfg.base_model,
                          workers=cfg.workers)
    _report(result, as_json, f"{cfg.local} now holds version {result['version']}"
            + ("" if result["changed"] else " (already there)"))
