import click

from rltool.commands.common import echo_json
from rltool.commands.options import command_options


def _input_options(fn):
    """One `--name` option per field of PlanInputs (help from the field's description)."""
    from rltool.profile.plan import PlanInputs

    for name, field in reversed(list(PlanInputs.model_fields.items())):
        flag = "--" + name.lower().replace("_", "-")
        kind = {int: int, float: float, str: str}.get(field.annotation, float)
        fn = click.option(flag, name, type=kind, default=None,
                          help=f"{field.description or name} [default: {field.default}]")(fn)
    return fn


@click.command("plan")
@click.option("--model", "model", type=click.Path(), default=None,
              help="The model's HF config.json (or its folder).")
@click.option("--from-profile", "from_profile", type=click.Path(exists=True), default=None,
              help="A traced run: its measured t_R, t_T, t_W, mu_P, mu_D, hit rate replace the "
                   "assumptions.")
@click.option("--check", "check_run", type=click.Path(exists=True), default=None,
              help="A traced loop run: print each checkable prediction's error.")
@click.option("--check-engine", "check_engine", default=None, metavar="URL",
              help="A live builtin engine: the hybrid-cache model's c_A, c_R, K slots and N "
                   "tokens against what it allocated (exit 1 past 2%).")
@click.option("--baseline-engine", "baseline_engine", default=None, metavar="URL",
              help="With --check-engine (an engine with the host KV tier): an engine without it "
                   "that served the same workload; checks the HiCache model instead (predicted "
                   "vs measured time-to-first-token saving; given HiCache inputs such as "
                   "--b-io-gbps replace measured ones).")
@click.option("--tolerance", "tolerance", type=float, default=None,
              help="Relative error past which a --check-engine check fails [default: 0.02 "
                   "hybrid cache, 0.2 HiCache].")
@click.option("--api-key", "api_key", default=None, envvar="RLTOOL_API_KEY",
              help="Bearer token for --check-engine and --baseline-engine.")
@click.option("--emit-sglang-config", "emit", type=click.Path(dir_okay=False), default=None,
              help="Write prefill/decode server groups in slime's --sglang-config YAML format, "
                   "and serving-reference.sh beside it.")
@click.option("--prefill-engines", type=int, default=None,
              help="Prefill engines of the SGLang config (default: the PD model's balanced "
                   "split).")
@click.option("--hicache/--no-hicache", default=True,
              help="Hierarchical cache on the prefill group.")
@click.option("--engine-urls", default=None,
              help="External engine addresses (refused with --emit-sglang-config).")
@_input_options
@command_options("json")
def command(model, from_profile, check_run, check_engine, baseline_engine, tolerance, api_key,
            emit, prefill_engines, hicache, engine_urls, as_json, **values):
    """Cost models for a model config and cluster: placement and memory, weight sync,
    async, precision, hybrid cache, prefill/decode disaggregation, HiCache.

    Example:
      rltool plan --model Qwen3-8B/config.json --gpus 16 --tp 2 --engine-tp 2
      rltool plan --check-engine http://127.0.0.1:30000
      rltool plan --check-engine http://127.0.0.1:30000 --baseline-engine http://127.0.0.1:30001
    """
    from pydantic import ValidationError

    from rltool.config import format_validation_error, url_error
    from rltool.errors import BadInputError
    from rltool.profile import plan as planner

    for flag, url in (("--check-engine", check_engine), ("--baseline-engine", baseline_engine)):
        if url and (problem := url_error(url)):
            raise BadInputError(f"{flag}: {problem}")
    if baseline_engine and not check_engine:
        raise BadInputError("--baseline-engine needs --check-engine URL (the engine with the "
                            "host KV tier)")
    if tolerance is not None and not (tolerance >= 0 and check_engine):
        raise BadInputError(f"--tolerance {tolerance:g}: give a value >= 0, with --check-engine")
    if baseline_engine:
        _check_hicache(check_engine, baseline_engine, api_key=api_key, model=model,
                       tolerance=tolerance, as_json=as_json,
                       overrides={k: v for k, v in values.items() if v is not None})
        return
    if check_engine:
        from rltool.profile.engine_check import TOLERANCE
        from rltool.profile.engine_check import check_engine as check_live

        result = check_live(_server_info(check_engine, api_key), url=check_engine, model=model,
                            tolerance=TOLERANCE if tolerance is None else tolerance)
        if as_json:
            echo_json(result)
        else:
            from rltool.commands.tables import print_rows

            print_rows(f"plan --check-engine {check_engine} ({result['budget_basis']})",
                       result["checks"])
        if not result["passed"]:
            import sys

            from rltool.errors import EXIT_CHECK_FAILED

            sys.exit(EXIT_CHECK_FAILED)
        return
    if check_run:
        result = planner.check(check_run, model=model)
        if as_json:
            echo_json(result)
            return
        from rltool.commands.tables import print_rows

        print_rows(f"plan --check {check_run}", result["checks"])
        click.echo("not checkable here: " + ", ".join(result["not_checkable"]))
        return
    if model is None:
        raise BadInputError("plan needs --model CONFIG.json (or --check RUN)")
    try:
        inputs = planner.PlanInputs(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as e:
        raise BadInputError(format_validation_error(e)) from None
    measured = None
    if from_profile:
        inputs, measured = planner.from_profile(inputs, from_profile)
    result = planner.plan(model, inputs, profile_run=from_profile)
    if measured is not None:
        result["measured"] = measured
    if emit:
        result["deployment"] = _emit(emit, model, inputs, prefill_engines=prefill_engines,
                                     hicache=hicache, engine_urls=engine_urls)
    if as_json:
        echo_json(result)
        return
    from rltool.commands.tables import print_plan

    print_plan(result)


def _check_hicache(url, baseline_url, *, api_key, model, tolerance, as_json, overrides):
    """The HiCache model against the tiered engine at `url` and the baseline at
    `baseline_url`."""
    from rltool.profile.serving_check import HICACHE_TOLERANCE, hicache_check

    check = hicache_check(_server_info(url, api_key), _server_info(baseline_url, api_key),
                          overrides=overrides, model=model,
                          tolerance=HICACHE_TOLERANCE if tolerance is None else tolerance)
    _report_check(check, title=f"plan --check-engine {url} --baseline-engine {baseline_url}",
                  engines={"engine": url, "baseline_engine": baseline_url}, as_json=as_json)


def _report_check(check, *, title, engines, as_json):
    """Any serving-model check (rltool.profile.serving_check.ModelCheck): a table of its inputs
    and outcomes (or --json), one verdict line on stderr, exit 1 past the tolerance."""
    if as_json:
        echo_json({**engines, **check.as_dict()})
    else:
        from rltool.commands.tables import print_rows

        rows = [{"quantity": q.name, "value": q.value, "from": q.source} for q in check.inputs]
        rows += [{"quantity": f"{q.name} {what}", "value": q.value, "from": q.source}
                 for what, q in (("predicted", check.predicted), ("measured", check.measured))]
        print_rows(f"{title} ({check.model})", rows)
    p, m = check.predicted, check.measured
    verdict = (f"{check.model}: predicted {p.name} {p.value:.6g}, measured {m.value:.6g}: "
               f"{check.relative_error:+.1%} (tolerance {check.tolerance:.0%})")
    if not check.passed:
        import sys

        from rltool.errors import EXIT_CHECK_FAILED

        click.echo(f"Error: {verdict}: past the tolerance", err=True)
        sys.exit(EXIT_CHECK_FAILED)
    click.echo(verdict, err=True)


def _server_info(url, api_key):
    """/get_server_info of the engine at `url`; a refused key is bad input (exit 2)."""
    import asyncio

    from rltool.errors import BadInputError, EngineError
    from rltool.rollout.client import EngineClient

    async def fetch():
        async with EngineClient(url, api_key=api_key, timeout_s=30.0, max_retries=0) as client:
            return await client.get_server_info()

    try:
        return asyncio.run(fetch())
    except EngineError as e:
        if e.status_code in (401, 403):
            raise BadInputError(f"{url} refused the key ({e.status_code}): pass the engine's "
                                "--api-key (or RLTOOL_API_KEY)") from None
        raise


def _emit(out, model, inputs, *, prefill_engines, hicache, engine_urls):
    from pathlib import Path

    from rltool.profile.caches import pd_split
    from rltool.profile.sglang import pd_groups, write_deployment

    rollout_gpus = inputs.rollout_gpus or inputs.gpus // 2
    engines = rollout_gpus // max(inputs.engine_tp, 1)
    if prefill_engines is None and engines >= 2:
        prefill_engines = pd_split(engines, mu_p=inputs.mu_P_rps, mu_d=inputs.mu_D_rps)
    groups = pd_groups(rollout_gpus=rollout_gpus, gpus_per_engine=inputs.engine_tp,
                       gpus_per_node=inputs.gpus_per_node, prefill_engines=prefill_engines or 0,
                       hicache=hicache,
                       engine_urls=[u for u in (engine_urls or "").split(",") if u])
    model_path = Path(model)
    model_path = model_path if model_path.is_dir() else model_path.parent
    return write_deployment(out, groups, model_path=str(model_path.resolve()),
                            gpus_per_node=inputs.gpus_per_node)
