"""Every option of every command reaches its stage config: the options are generated from the
config models, and this walks the click commands to prove each one is wired through."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from pydantic_core import PydanticUndefined

import rltool.config
from rltool.cli import main
from rltool.commands.options import StageArgument, StageOption
from rltool.loop.config import LoopSettings


def walk_commands():
    """(argv path, click command) for every leaf command of `rltool`."""
    ctx = click.Context(main)
    for name in main.list_commands(ctx):
        cmd = main.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            for sub_name, sub in cmd.commands.items():
                yield (name, sub_name), sub
        else:
            yield (name,), cmd


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    for name in ("model", "model2"):
        (root / name).mkdir()
        (root / name / "config.json").write_text("{}")
    model = root / "model"
    loop = root / "loop.toml"
    loop.write_text(
        f'[model]\npath = "{model}"\n'
        '[rollout]\nprompts = "p.jsonl"\nreward = "reverse"\nmax_response_len = 4\n'
        'rollout_batch_size = 2\nn_samples_per_prompt = 2\n'
        '[train]\nlr = 1e-3\n[sync]\n[eval]\nprompts = "e.jsonl"\n[loop]\nnum_steps = 2\n')
    return {"model": str(model), "model2": str(root / "model2"), "loop": str(loop)}


def base_args(path, files):
    """Values (by field) that make each command's config valid on their own."""
    rollout = {"engines": ["http://e:1"], "prompts": ["p.jsonl"], "out": ["o"],
               "max_response_len": ["4"], "reward": ["reverse"], "n_samples_per_prompt": ["2"]}
    return {
        ("align-gate",): {"rollouts": ["r"], "weights": ["w"]},
        ("rollout",): rollout | {"rollout_batch_size": ["2"]},
        ("eval",): rollout,
        ("train",): {"rollouts": ["r"], "load": ["l"]},
        # cpu: so that checks of the GPU engine (device-dependent) do not depend on the machine
        ("serve",): {"model": [files["model"]], "device": ["cpu"]},
        ("convert", "fp8"): {"hf": ["h"], "out": ["o"]},
        ("convert", "int4"): {"hf": ["h"], "out": ["o"]},
        ("convert", "dequant"): {"hf": ["h"], "out": ["o"]},
        ("convert", "hf-to-dist"): {"hf": ["h"], "out": ["o"]},
        ("convert", "dist-to-hf"): {"dist": ["d"], "hf_config": ["c"], "out": ["o"]},
        ("delta", "diff"): {"base": ["b"], "new": ["n"], "out": ["o"]},
        ("delta", "apply"): {"base": ["b"], "delta": ["d"], "out": ["o"]},
        ("delta", "verify"): {"path": ["p"]},
        ("delta", "pull"): {"local": ["l"], "source": ["s"], "version": ["1"]},
        ("data", "make"): {"task": ["reverse"], "num": ["3"], "out": ["o.jsonl"]},
        ("init-model",): {"out": ["o"]},
        ("report",): {"run_dir": ["run"]},
        ("shards", "inspect"): {"path": ["p"]},
        ("loop",): {},
        ("env", "serve"): {"env": ["guess"]},
    }[path]


# Options that a cross-field check ties to another: given together with these.
COMPANIONS = {
    "layerwise": ["--engine", "http://e:1"],
    "kl_coef": ["--ref", "r", "--advantage-estimator", "ppo"],
    "kl_loss_coef": ["--ref", "r"],
    "lr_decay_style": ["--lr-decay-steps", "5"],
    "encoding": ["--format", "slime"],
    "host": ["--admin-api-key", "k"],  # a non-loopback host needs the admin key
    # megatron-only options are refused with the default torch backend
    **{field: ["--backend", "megatron"] for field in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
        "use_distributed_optimizer", "transformer_impl")},
    "param_dtype": ["--dtype", "bf16"],  # bf16 parameters compute in bf16
    **{field: ["--lora-rank", "4"] for field in (  # LoRA's knobs need LoRA on
        "lora_alpha", "lora_dropout", "lora_target_modules", "lora_merge_on_publish")},
    # megatron's optimizer offload runs on its distributed optimizer
    "optimizer_offload_fraction": ["--backend", "megatron", "--use-distributed-optimizer",
                                   "--optimizer-cpu-offload"],
    "mode": ["--placement", "disaggregated"],  # async refuses colocated placement
    "opd_teacher_route": ["--opd-teacher", "a=http://x:1"],
    "opd_mode": ["--opd-teacher", "x"],
    ("serve", "lora_paths"): ["--enable-lora"],  # adapters at start need LoRA on
    ("serve", "max_lora_rank"): ["--enable-lora"],  # the rank cap is LoRA's
    "admin_key_hosts": ["--router-url", "http://g:1"],  # the gateway's workers
    ("loop", "engine"): ["--sync", "auto"],  # the in-process engine takes in-memory sync only
    ("env", "host"): ["--api-key", "k"],  # a non-loopback host needs the key
}
# Fields whose test replaces part of the base (exclusive with it).
REPLACES = {("train", "prompts"): {"rollouts": None, "loss": ["sft"]},
            ("rollout", "router"): {"engines": None}, ("eval", "router"): {"engines": None},
            # the environment rewards: --env replaces --reward
            ("rollout", "env"): {"reward": None}, ("eval", "env"): {"reward": None}}
# Fields whose value must name something real (a file of the fixture).
REAL_VALUES = {("serve", "model"): "model2"}


def build_argv(cmd, base, *, skip):
    argv, positional = [], []
    params = {p.name: p for p in cmd.params}
    for field, values in base.items():
        if field == skip or values is None or field not in params:
            continue
        param = params[field]
        if isinstance(param, StageArgument):
            positional += values
        else:
            argv += [param.opts[0], *values]
    return argv, positional


# Fields whose values must be engine URLs (rollout, eval, loop and align-gate check them up front).
URL_FIELDS = {"engines", "router", "router_url", "engine_urls", "opd_teacher", "engine"}


def candidates(param: StageOption, default):
    """Command-line values (and what the config must then hold) that differ from the default."""
    if isinstance(param.type, click.Choice):  # loop's and serve's --engine among them
        return [([c], c) for c in param.type.choices if c != default] or [([default], default)]
    if param.field in URL_FIELDS:
        urls = ["http://a:1", "http://b:1"]
        return [([",".join(urls)], urls)] if param.multiple else [([urls[0]], urls[0])]
    if param.secondary_opts:  # --x/--no-x
        return [([], not default)]
    if param.multiple:  # a list of strings, else of integers (CPU cores: 0 exists everywhere)
        return [(["x-a,x-b"], ["x-a", "x-b"]), (["0"], [0])]
    if param.nargs == 2:
        return [(["3", "5"], [3, 5])]
    kind = param.type.name
    if kind == "integer":
        start = default if isinstance(default, int) else 0
        return [([str(v)], v) for v in (start + 1, start + 2, 7) if v != default]
    if kind == "float":
        values = ([default / 2, default * 2] if default else []) + [0.5, 1.5, 3.0]
        return [([repr(v)], v) for v in values if v != default]
    return [([f"x-{param.name}"], f"x-{param.name}")]


def norm(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [norm(v) for v in value]
    return value


class Built(Exception):
    pass


@pytest.fixture
def capture(monkeypatch):
    """Stop each command right after it built its config; the configs land in the list."""
    built = []
    real_resolve = rltool.config.resolve
    real_from_file = LoopSettings.from_file.__func__

    def resolve(model, **kwargs):
        built.append(real_resolve(model, **kwargs))
        raise click.exceptions.Exit(0)

    def from_file(cls, path, *, overrides=None):
        built.append(real_from_file(cls, path, overrides=overrides))
        raise click.exceptions.Exit(0)

    monkeypatch.setattr(rltool.config, "resolve", resolve)
    monkeypatch.setattr(LoopSettings, "from_file", classmethod(from_file))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield built
    for s, h in handlers.items():  # `rltool loop` installs its own
        signal.signal(s, h)


def run_to_config(built, path, argv, positional, files, env=None):
    built.clear()
    config = ["--config", files["loop"]] if path == ("loop",) else []
    result = CliRunner().invoke(main, [*path, *argv, *config, *positional], env=env)
    if result.exit_code != 0 or not built:
        return None, result.output
    cfg = built[-1]
    return cfg, result.output


def carried(cfg, param):
    if isinstance(cfg, LoopSettings):
        cfg = getattr(cfg, param.table)
    return norm(getattr(cfg, param.field))


@pytest.mark.timeout(120)
def test_every_option_of_every_command_reaches_its_stage_config(files, capture):
    """Bug: `rltool align-gate --device cuda` was silently ignored (a hand-kept flag list left it
    out). Each option, set to a value other than its default, must show up in the config the
    command builds."""
    checked, problems = 0, []
    for path, cmd in walk_commands():
        base = base_args(path, files) if any(
            isinstance(p, (StageOption, StageArgument)) for p in cmd.params) else None
        if base is None:
            continue
        # the base alone builds (otherwise every failure below would be about the base)
        base_cfg, output = run_to_config(capture, path, *build_argv(cmd, base, skip=None), files)
        assert base_cfg is not None, f"{' '.join(path)}: base arguments do not build: {output}"
        for param in cmd.params:
            if not isinstance(param, (StageOption, StageArgument)):
                continue
            model_field = type(base_cfg if not isinstance(base_cfg, LoopSettings)
                               else getattr(base_cfg, param.table)).model_fields[param.field]
            default = model_field.get_default(call_default_factory=True)
            default = None if default is PydanticUndefined else norm(default)
            this_base = dict(base)
            this_base.update(REPLACES.get((path[0], param.field), {}))
            argv, positional = build_argv(cmd, this_base, skip=param.field)
            argv += COMPANIONS.get((path[0], param.field), COMPANIONS.get(param.field, []))
            if (path[0], param.field) in REAL_VALUES:
                real = files[REAL_VALUES[path[0], param.field]]
                tries = [([param.opts[0], real], real)]
            elif isinstance(param, StageArgument):
                tries = [([], f"x-{param.name}")]
            else:
                tries = [(param.opts[0:1] + values if not param.secondary_opts else
                          [param.opts[0] if expected else param.secondary_opts[0]], expected)
                         for values, expected in candidates(param, default)]
            errors = []
            for values, expected in tries:
                args = (argv, positional + [expected]) if isinstance(param, StageArgument) \
                    else (argv + values, positional)
                cfg, output = run_to_config(capture, path, *args, files)
                if cfg is None:
                    errors.append(output.strip().splitlines()[-1:] if output else "no output")
                    continue
                if carried(cfg, param) != expected:
                    problems.append(f"{' '.join(path)} {param.name} {values}: config holds "
                                    f"{carried(cfg, param)!r}")
                break
            else:
                problems.append(f"{' '.join(path)} {param.name}: no value builds: {errors}")
            checked += 1
    assert not problems, "\n".join(problems)
    assert checked > 150  # the walk really visited the commands' options


def test_environment_fallbacks_reach_the_config(files, capture):
    """Options declared with an environment variable (API keys) take it when not given."""
    seen = 0
    for path, cmd in walk_commands():
        for param in cmd.params:
            if isinstance(param, StageOption) and param.envvar:
                argv, positional = build_argv(cmd, base_args(path, files), skip=None)
                cfg, output = run_to_config(capture, path, argv, positional, files,
                                            env={param.envvar: "k-from-env"})
                assert cfg is not None, output
                assert carried(cfg, param) == "k-from-env", (path, param.name)
                seen += 1
    assert seen >= 4  # rollout, eval, align-gate, serve (two keys)


def test_help_shows_the_model_defaults_once():
    """Defaults come from the model: `--help` shows the model's value, and the help text of a
    stage option is exactly the field's description plus that default."""
    from rltool.align.config import AlignGateConfig

    result = CliRunner().invoke(main, ["align-gate", "--help"])
    assert result.exit_code == 0
    flat = " ".join(result.output.split())
    assert "--device [auto|cpu|cuda]" in flat and "[default: cpu]" in flat
    assert "[env var: RLTOOL_API_KEY]" in flat
    cmd = main.get_command(click.Context(main), "align-gate")
    for param in cmd.params:
        if isinstance(param, StageOption):
            field = AlignGateConfig.model_fields[param.field]
            assert param.help.startswith(field.description), param.name


@pytest.mark.parametrize("argv, field, expected", [
    (["align-gate", "--device", "cuda", "--rollouts", "r", "--weights", "w"], "device", "cuda"),
    (["train", "--rollouts", "a,b", "--rollouts", "c", "--load", "l"], "rollouts",
     ["a", "b", "c"]),
    (["rollout", "--engines", "http://a:1,http://b:2/", "--prompts", "p", "--out", "o",
      "--max-response-len", "4", "--reward", "r", "--rollout-batch-size", "2"], "engines",
     ["http://a:1", "http://b:2"]),
    (["train", "--dtype", "bfloat16", "--rollouts", "r", "--load", "l"], "dtype", "bf16"),
    (["align-gate", "--dtype", "float32", "--rollouts", "r", "--weights", "w"], "dtype", "fp32"),
    (["init-model", "--dtype", "bfloat16", "--out", "o"], "dtype", "bf16"),
    (["convert", "dequant", "--dtype", "float16", "--hf", "h", "--out", "o"], "dtype", "fp16"),
    (["convert", "hf-to-dist", "--dtype", "bf16", "--hf", "h", "--out", "o"], "dtype", "bf16"),
])
def test_list_and_alias_mechanisms(capture, argv, field, expected):
    """Lists are repeatable and comma-separated; dtypes have one spelling (fp32|bf16|fp16) and
    accept torch's long names as aliases."""
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0 and capture, result.output
    assert getattr(capture[-1], field) == expected


def test_dtype_spelling_is_one_everywhere():
    """Every dtype option offers the short names only (the long ones are aliases)."""
    for path, cmd in walk_commands():
        for param in cmd.params:
            if isinstance(param, StageOption) and param.field == "dtype":
                assert set(param.type.choices) <= {"auto", "fp32", "bf16", "fp16"}, path


def test_verbosity_options_and_logging_are_everywhere():
    """-q/-v on every command; one logging setup silences httpx's per-request INFO lines."""
    import logging

    from rltool.logs import setup_logging

    for path, cmd in walk_commands():
        names = {opt for p in cmd.params for opt in p.opts}
        assert {"-q", "-v", "--quiet", "--verbose"} <= names, path
    setup_logging(verbosity=0)
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
    assert logging.getLogger("rltool").getEffectiveLevel() == logging.INFO
    setup_logging(verbosity=1)
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.INFO
    assert logging.getLogger("rltool").getEffectiveLevel() == logging.DEBUG
    setup_logging(verbosity=-1)
    assert logging.getLogger("rltool").getEffectiveLevel() == logging.WARNING
    setup_logging(verbosity=0)


def test_quiet_reaches_the_stage_quiet_field(capture):
    result = CliRunner().invoke(main, ["rollout", "-q", "--engines", "http://e:1", "--prompts",
                                       "p", "--out", "o", "--max-response-len", "4", "--reward",
                                       "r", "--rollout-batch-size", "2"])
    assert result.exit_code == 0, result.output
    assert capture[-1].quiet is True
    assert json.dumps(capture[-1].model_dump(mode="json"))  # still a plain config


def test_generator_maps_each_field_kind():
    """The generator on a model of its own: every field kind gets its one command-line form,
    new fields need no hand edits, and a field with no command-line form is an error at once."""
    from typing import Literal

    from pydantic import Field

    from rltool.commands.options import build_config, command_options, stage_options
    from rltool.config import ComputeDtype, StageConfig, cli

    class Model(StageConfig):
        subject: str = Field(description="Positional.", json_schema_extra=cli(argument=True))
        dtype: ComputeDtype | None = Field(None, description="Optional aliased choice.")
        mode: Literal["a", "b"] = Field("a", description="Choice.")
        dirs: list[str] = Field(default_factory=list, description="List.")
        block: tuple[int, int] = Field((1, 2), description="Pair.")
        flag: bool = Field(True, description="Bool.")
        rate: float = Field(0.5, description="Float.")
        key: str | None = Field(None, description="Key.", json_schema_extra=cli(envvar="T_KEY"))
        hidden: int = Field(3, description="File only.", json_schema_extra=cli(option=False))

    seen = {}

    @click.command()
    @stage_options(Model, table="t")
    @command_options("config")
    def cmd(**_):
        seen["cfg"] = build_config(Model, table="t")

    result = CliRunner().invoke(cmd, ["S", "--dtype", "bfloat16", "--mode", "b", "--dirs", "x,y",
                                      "--dirs", "z", "--block", "3", "4", "--no-flag", "--rate",
                                      "2.5"], env={"T_KEY": "secret"})
    assert result.exit_code == 0, result.output
    assert seen["cfg"] == Model(subject="S", dtype="bf16", mode="b", dirs=["x", "y", "z"],
                                block=(3, 4), flag=False, rate=2.5, key="secret")
    assert "--hidden" not in CliRunner().invoke(cmd, ["--help"]).output
    bad = CliRunner().invoke(cmd, ["S", "--dtype", "fp16"])
    assert bad.exit_code == 2 and "'fp16' is not one of 'fp32', 'bf16'" in bad.output

    class Unsupported(StageConfig):
        table: dict[str, int] = Field(default_factory=dict, description="No flag form.")

    with pytest.raises(TypeError, match="cli\\(option=False\\)"):
        stage_options(Unsupported, table="u")
