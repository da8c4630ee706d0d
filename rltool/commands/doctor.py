import click

from rltool.commands.common import echo_json
from rltool.commands.options import command_options


@click.command("doctor")
@command_options("json")
def command(as_json):
    """Report what this machine can run: versions of torch, CUDA, transformers, megatron-core,
    sglang, transformer-engine and Ray; the GPUs and their memory; whether the native kernels are
    built; and which tiers (cpu, gpu, megatron, sglang) can run here, and why not.

    Writes nothing; always exits 0 (read the tiers, or `--json`'s "tiers", to decide).

    Example:
      rltool doctor
      rltool doctor --json | jq '.tiers.gpu'
    """
    from rltool.doctor import diagnose

    report = diagnose()
    if as_json:
        echo_json(report)
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(markup=False)  # "rltool[sglang]" is text, not markup
    cuda = report["cuda"]
    versions = Table(title=f"rltool {report['rltool']} on Python {report['python']}")
    versions.add_column("package")
    versions.add_column("version")
    versions.add_column("status")
    for name, info in report["packages"].items():
        versions.add_row(name, info["version"] or "-", info["status"])
    versions.add_row("CUDA (torch build)", cuda["torch_cuda"] or "-",
                     "ok" if cuda["available"] else cuda["reason"])
    native = report["native_kernels"]
    versions.add_row("native kernels", "-", f"built: {native['path']}" if native["built"] else
                     "not built (pip install -e . builds them; torch fallbacks are used)")
    console.print(versions)
    if cuda["devices"]:
        devices = Table(title="GPUs")
        for column in ("index", "name", "memory_gib", "capability"):
            devices.add_column(column)
        for d in cuda["devices"]:
            devices.add_row(*(str(d[c]) for c in ("index", "name", "memory_gib", "capability")))
        console.print(devices)
    tiers = Table(title="tiers")
    tiers.add_column("tier")
    tiers.add_column("runs here")
    tiers.add_column("why")
    for name, tier in report["tiers"].items():
        tiers.add_row(name, "yes" if tier["ok"] else "no", tier["why"])
    console.print(tiers)
