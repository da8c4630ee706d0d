import click

from rltool.commands.common import echo_json
from rltool.commands.options import build_config, command_options, stage_options
from rltool.env.config import EnvServeConfig

TABLE = "env"


@click.group("env")
def command():
    """Environments for agentic RL: list the built-ins, serve one over HTTP (docs/agentic.md)."""


@command.command("list")
@command_options("json")
def list_(as_json, **_):
    """List the built-in environments (names for --env).

    \b
    Example:
      rltool env list --json
    """
    from rltool.env.builtins import BUILTINS

    rows = [{"name": name, "description": cls.description, "stop": list(cls.stop)}
            for name, cls in sorted(BUILTINS.items())]
    if as_json:
        echo_json(rows)
        return
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        click.echo(f"{r['name']:<{width}}  {r['description']}")


@command.command("serve")
@stage_options(EnvServeConfig, table=TABLE)
@command_options("config")
def serve(**_):
    """Serve an environment over HTTP: one episode per client session, per-call timeouts and a
    limit on open episodes; binds 127.0.0.1 unless --host says otherwise (then --api-key is
    required). `rltool rollout --env http://HOST:PORT` drives it.

    \b
    Example:
      rltool env serve --env python --port 8300 --api-key "$KEY" --max-episodes 64
    """
    from rltool.env.server import serve as run_server

    run_server(build_config(EnvServeConfig, table=TABLE))
