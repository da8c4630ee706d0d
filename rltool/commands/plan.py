import click

from rltool.commands.common import echo_json, handle_errors, json_option


def _input_options(fn):
    """One `--name` option per field of PlanInputs (help from the field's description)."""
    from rltool.profile.plan import PlanInputs

    for name, field in reversed(list(PlanInputs.model_fields.items())):
        flag = "--" + name.replace("_", "-")
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
@_input_options
@json_option
@handle_errors
def command(model, from_profile, check_run, as_json, **values):
    """Cost models for a model config and cluster: placement and memory, weight sync,
    async, precision, hybrid cache, prefill/decode disaggregation, HiCache.

    Example:
      rltool plan --model Qwen3-8B/config.json --gpus 16 --tp 2 --engine-tp 2
    """
    from rltool.errors import BadInputError
    from rltool.profile import plan as planner

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
    except ValueError as e:
        raise BadInputError(f"plan: {str(e).splitlines()[0]}: "
                            f"{'; '.join(str(e).splitlines()[1:3])}") from None
    measured = None
    if from_profile:
        inputs, measured = planner.from_profile(inputs, from_profile)
    result = planner.plan(model, inputs)
    if measured is not None:
        result["measured"] = measured
    if as_json:
        echo_json(result)
        return
    from rltool.commands.tables import print_plan

    print_plan(result)
