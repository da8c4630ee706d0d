import click

from rltool.commands.options import build_config, command_options, stage_options
from rltool.engine.config import ServeConfig


@click.command("serve", context_settings={"ignore_unknown_options": True,
                                          "allow_extra_args": True})
@stage_options(ServeConfig, table="serve")
@command_options("config")
def command(**_):
    """Serve a model over SGLang's HTTP API: the builtin continuous-batching engine, a managed
    SGLang server, or an external engine to attach to.

    Runs until SIGTERM/SIGINT (external: returns once the engine is healthy). Endpoints, flags,
    the SGLang flag mapping and differences from SGLang: docs/serve.md.

    Example:
      rltool serve --engine builtin --model models/tiny --port 0 --ready-file /tmp/engine.json
      rltool serve --engine sglang --model models/qwen --sglang-tp-size 2 --port 30000
    """
    ctx = click.get_current_context()
    # Options rltool does not know are SGLang's (--sglang-<opt>), checked by ServeConfig.
    cfg = build_config(ServeConfig, table="serve",
                       extra={"sglang_args": list(ctx.args)} if ctx.args else None)
    if cfg.engine == "builtin":
        from rltool.engine.server import serve

        serve(cfg)
    elif cfg.engine == "sglang":
        from rltool.rollout.sglang_server import serve_sglang

        serve_sglang(cfg)
    else:
        from rltool.rollout.sglang_server import attach_external

        click.echo(attach_external(cfg))
