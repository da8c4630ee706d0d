import click

from rltool.commands.common import config_option, explicit_flags, handle_errors, setup_logging

FLAGS = ["engine", "url", "health_timeout_s", "model", "host", "port", "ready_file", "device", "dtype",
         "mem_fraction_static", "page_size", "chunked_prefill_size", "cuda_graph_max_bs",
         "disable_cuda_graph",
         "max_running_requests", "max_queued_requests", "max_prefill_tokens", "deterministic",
         "num_threads", "weight_version", "served_model_name", "log_level",
         "enable_debug_endpoints", "local_checkpoint_dir", "allowed_weight_root", "api_key",
         "admin_api_key", "allow_unauthenticated_admin", "max_request_bytes"]


@click.command("serve", context_settings={"ignore_unknown_options": True,
                                          "allow_extra_args": True})
@click.option("--engine", type=click.Choice(["builtin", "sglang", "external"]), default=None,
              help="builtin (default), sglang (managed sglang.launch_server; --sglang-<opt> "
                   "options pass through as --<opt>), or external (attach to --url).")
@click.option("--url", default=None, help="--engine external: URL of the running engine.")
@click.option("--health-timeout-s", type=float, default=None,
              help="--engine sglang/external: seconds to wait for /health (default 600).")
@click.option("--model", type=click.Path(file_okay=False), default=None,
              help="HF checkpoint directory to serve.")
@click.option("--host", default=None, help="Bind address (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port (default 30000; 0 = any free port).")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
              help="Write {url, pid} here (atomically) once the engine serves.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="--engine builtin: cuda (paged KV, CUDA graphs), cpu, or auto (default: cuda "
                   "when available).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default=None,
              help="Weight/compute dtype (default bf16 on cuda, fp32 on cpu).")
@click.option("--mem-fraction-static", type=float, default=None,
              help="cuda: weights + KV pool as a fraction of GPU memory (default 0.85).")
@click.option("--page-size", type=int, default=None,
              help="cuda: tokens per KV-cache page (default 16).")
@click.option("--chunked-prefill-size", type=int, default=None,
              help="Largest prefill chunk of one prompt (default 8192 on cuda, "
                   "--max-prefill-tokens on cpu).")
@click.option("--cuda-graph-max-bs", type=int, default=None,
              help="cuda: largest decode batch replayed from a CUDA graph (default 256).")
@click.option("--disable-cuda-graph", is_flag=True, default=None,
              help="cuda: run every decode step eagerly.")
@click.option("--max-running-requests", type=int, default=None,
              help="Largest decode batch (default 64).")
@click.option("--max-queued-requests", type=int, default=None,
              help="Waiting requests beyond the running ones before 429 (default 4096).")
@click.option("--max-prefill-tokens", type=int, default=None,
              help="Prompt tokens prefilled per scheduler step (default 16384 on cuda, 512 "
                   "on cpu).")
@click.option("--deterministic", is_flag=True, default=None,
              help="Seeded, batch-invariant sampling; logprobs in the trainer's layout.")
@click.option("--num-threads", type=int, default=None,
              help="torch intra-op threads (default: torch's; 1 is best on a busy machine).")
@click.option("--weight-version", default=None, help="Initial weight_version (default 'default').")
@click.option("--served-model-name", default=None, help="Model name reported to clients.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default=None, help="Server log level (default info).")
@click.option("--enable-debug-endpoints", is_flag=True, default=None,
              help="Mount POST /debug/hidden_states (align-gate --layerwise); off by default.")
@click.option("--api-key", default=None, envvar="RLTOOL_API_KEY",
              help="Bearer key every route but /health* needs (env RLTOOL_API_KEY).")
@click.option("--admin-api-key", default=None, envvar="RLTOOL_ADMIN_API_KEY",
              help="Bearer key for the routes that change state (weights, cache, pause, abort, "
                   "memory, debug); required with a non-loopback --host.")
@click.option("--allow-unauthenticated-admin", is_flag=True, default=None,
              help="Serve on a non-loopback --host without --admin-api-key (refused otherwise).")
@click.option("--max-request-bytes", type=int, default=None,
              help="Largest request body; 413 beyond (default 64 MiB).")
@click.option("--local-checkpoint-dir", type=click.Path(file_okay=False), default=None,
              help="Host-local directory /pull_weights writes into (an allowed weight root).")
@click.option("--allowed-weight-root", type=click.Path(file_okay=False), multiple=True,
              help="Weight paths must lie under one of these (repeatable; default: the model's "
                   "parent directory and --local-checkpoint-dir).")
@config_option
@handle_errors
def command(config_file, **_):
    """Serve a model over SGLang's HTTP API: the builtin continuous-batching engine, a managed
    SGLang server, or an external engine to attach to.

    Runs until SIGTERM/SIGINT (external: returns once the engine is healthy). Endpoints, flags,
    the SGLang flag mapping and differences from SGLang: docs/serve.md.

    Example:
      rltool serve --engine builtin --model models/tiny --port 0 --ready-file /tmp/engine.json
      rltool serve --engine sglang --model models/qwen --sglang-tp-size 2 --port 30000
    """
    from rltool.config import resolve
    from rltool.engine.config import ServeConfig

    ctx = click.get_current_context()
    flags = explicit_flags(ctx, FLAGS)
    if ctx.args:
        flags["sglang_args"] = list(ctx.args)
    cfg = resolve(ServeConfig, config_file=config_file, section="serve", flags=flags)
    setup_logging()
    if cfg.engine == "builtin":
        from rltool.engine.server import serve

        serve(cfg)
    elif cfg.engine == "sglang":
        from rltool.rollout.sglang_server import serve_sglang

        serve_sglang(cfg)
    else:
        from rltool.rollout.sglang_server import attach_external

        click.echo(attach_external(cfg))
