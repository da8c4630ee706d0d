"""The phases of one synchronous step, each a function of a `StepContext`:

rollout  -> RUN/rollouts/step-K/ (shard, `_SUCCESS`), metrics/rollout.jsonl
train    -> metrics/train.jsonl; RUN/train/ckpt/step-V/ (`trainer_state.json`) every step when
            disaggregated, every `save_interval` steps and at the end when colocated
publish  -> RUN/weights/weight_vV/ (full or delta, rltool.delta.publish.publish_version); with an
            in-memory sync (tensor, distributed) only at checkpoint steps
sync     -> every engine serves version V (pull for a delta, then /update_weights_from_disk; or
            the resident trainer's tensors through shared memory or a gloo broadcast)
eval     -> RUN/eval/step-K/ (shard), metrics/eval.jsonl, every `eval_interval` steps

Each phase first checks its artifact's marker, so a phase that completed before a kill (even one
not yet recorded in state.json) is not redone, and nothing is duplicated.

Colocated placement keeps one `ResidentTrainer` in the loop's process for the whole run. After a
kill it is rebuilt from the newest checkpoint and replays the steps trained after it from their
rollout shards (deterministic mode: bit-identical), so a checkpoint per step is not needed. On
CUDA it takes turns on the device with the engines (rltool.loop.colocation).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltool import atomic, trace
from rltool.errors import EngineError, GateFailedError
from rltool.loop import lora_sync
from rltool.loop.config import LoopSettings
from rltool.loop.engines import ChildRegistry, EngineSet, TrainerProcess
from rltool.loop.colocation import PhaseMemory, Residency
from rltool.loop.state import LoopState
from rltool.rundir import RunDir, read_metrics

log = logging.getLogger(__name__)
ALIGN_METRIC = "train/train_rollout_logprob_abs_diff"


@dataclass
class StepContext:
    run: RunDir
    settings: LoopSettings
    engines: EngineSet
    registry: ChildRegistry
    state: LoopState
    trainer: Any = None  # the ResidentTrainer (colocated placement), built on first use
    residency: Any = None  # a Residency: who holds the device in each phase
    memory: PhaseMemory | None = None
    # Per phase of this step: CPU seconds of the loop process (all its threads: an in-process
    # engine's too), beside the wall seconds; less moved by other load on a shared machine.
    cpu_seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.residency is None:
            self.residency = Residency(self.settings, self.engines,
                                       resident=is_resident(self.settings),
                                       disk_sync=sync_mode(self.settings) == "disk")
        if self.memory is None:
            self.memory = PhaseMemory(active=self.settings.device == "cuda")


def rollout(ctx: StepContext) -> None:
    from rltool.data.shards import MANIFEST
    from rltool.rollout.stage import run as run_rollout

    out = ctx.run.rollout_step(ctx.state.step)
    if (out / MANIFEST).exists():
        return
    atomic.remove_stale_temporaries(ctx.run.rollouts)
    ctx.residency.for_engines(ctx.trainer)
    run_rollout(ctx.settings.rollout_config(ctx.run, step=ctx.state.step, urls=ctx.engines.urls),
                clients=ctx.engines.clients)


def newest_checkpoint_version(run: RunDir) -> int | None:
    from rltool.train.checkpoint import STATE_FILE
    from rltool.rundir import parse_step_dir_name

    if not run.ckpt.is_dir():
        return None
    versions = [v for p in run.ckpt.iterdir()
                if (v := parse_step_dir_name(p.name)) is not None and (p / STATE_FILE).exists()]
    return max(versions, default=None)


def train_load_path(run: RunDir, version: int, *, initial: Path | None = None) -> Path:
    """What the trainer resumes from: the checkpoint that produced `version`, else the initial
    weights (version 0 has no checkpoint): `initial`, or version 0 as published."""
    ckpt = run.ckpt_step(version)
    return ckpt if version > 0 and ckpt.exists() else initial or run.weight_version(0)


def initial_weights(settings: LoopSettings) -> Path | None:
    """The trainer's starting weights when version 0 is not them: the model itself when versions
    are published block-FP8 or INT4 (the trainer trains the unquantized weights)."""
    return Path(settings.model.path) if settings.sync.precision in ("fp8", "int4") else None


def in_memory_transport(settings: LoopSettings) -> str | None:
    """What the engines can take in memory: the loop's builtin engines share its host (and,
    colocated, its device), so "tensor" (shared memory) whenever the trainer is resident; external
    engines can join its broadcast ("distributed"); disaggregated synchronous runs and Ray actors
    publish to disk."""
    if not is_resident(settings):
        return None
    return "distributed" if settings.loop.external else "tensor"


def is_resident(settings: LoopSettings) -> bool:
    """Whether the trainer lives in the loop's process (colocated, or the asynchronous loop),
    launched locally; under Ray it runs per step in an actor."""
    return settings.loop.launcher == "local" and (settings.loop.placement == "colocated"
                                                  or settings.loop.mode == "async")


def sync_mode(settings: LoopSettings) -> str:
    """The transport of every step after version 0 (the publish decide step, without weights)."""
    from rltool.delta.publish import decide_transport

    decision = decide_transport(settings.sync, in_memory=in_memory_transport(settings))
    return decision.in_memory if decision is not None else "disk"


def is_save_step(settings: LoopSettings, step: int) -> bool:
    return (step + 1) % settings.loop.save_interval == 0 or step == settings.loop.num_steps - 1


def _checkpoint_loop_step(run: RunDir, ckpt: Path) -> int:
    """The loop step a checkpoint finished: recorded by the resident trainer, else (a checkpoint
    of the disaggregated trainer) the rollout step of its train.jsonl row."""
    from rltool.train.checkpoint import read_trainer_state

    state = read_trainer_state(ckpt)
    if "loop_step" in state:
        return int(state["loop_step"])
    rows = [r for r in read_metrics(run.metrics_file("train"))
            if r.get("policy_version") == state.get("policy_version") and "rollout_step" in r]
    if not rows:
        raise EngineError(f"{ckpt}: cannot tell which loop step it finished; resume with "
                          "--placement disaggregated")
    return int(rows[-1]["rollout_step"])


def resident_trainer(ctx: StepContext) -> Any:
    """The resident trainer, rebuilt after a restart from the newest checkpoint (or version 0)
    and brought to the last trained step by replaying the steps after it."""
    from rltool.train.resident import ResidentTrainer

    if ctx.trainer is not None:
        ctx.residency.reload_trainer(ctx.trainer)
        return ctx.trainer
    ctx.residency.before_trainer(training=False)  # CUDA colocated: the device is the trainer's
    state, run = ctx.state, ctx.run
    newest = newest_checkpoint_version(run)
    load = (run.ckpt_step(newest) if newest is not None
            else initial_weights(ctx.settings) or run.weight_version(0))
    trainer = ResidentTrainer(ctx.settings.train_config(run, step=0, load=str(load)))
    if newest is not None:
        trainer.loop_step = _checkpoint_loop_step(run, run.ckpt_step(newest))
    else:  # the run's version 0, whatever version the model's directory declares (fp8: the model)
        trainer.version = 0
    last_trained = state.step if state.completed("train") else state.step - 1
    for step in range(trainer.loop_step + 1, last_trained + 1):
        log.info("replaying loop step %d from its rollouts", step)
        trainer.train(ctx.settings.train_config(run, step=step, load=str(load)), loop_step=step,
                      log_metrics=False)
    if trainer.loop_step == last_trained and trainer.version != state.policy_version:
        raise EngineError(f"replaying to step {last_trained} gave policy version "
                          f"{trainer.version}, state.json says {state.policy_version}; the run "
                          "directory was changed by hand")
    ctx.trainer = trainer
    return trainer


def _train_resident(ctx: StepContext) -> None:
    state, settings, run = ctx.state, ctx.settings, ctx.run
    ctx.residency.before_trainer(training=ctx.trainer is None or ctx.trainer.loop_step
                                 < state.step)
    trainer = resident_trainer(ctx)
    if trainer.loop_step < state.step:
        ctx.residency.before_trainer(training=True)  # an in-memory sync writes into the engines
        trainer.train(settings.train_config(run, step=state.step, load=str(settings.model.path)),
                      loop_step=state.step)
    if is_save_step(settings, state.step) and not trainer.checkpoint_dir(run.ckpt).exists():
        atomic.remove_stale_temporaries(run.ckpt)
        trainer.save(run.ckpt)
    state.base_version = state.policy_version
    state.policy_version = trainer.version


def save_resident(ctx: StepContext) -> None:
    """Checkpoint the resident trainer unless its state is saved already (a run stopped early)."""
    trainer = ctx.trainer
    if trainer is not None and trainer.loop_step >= 0 and \
            not trainer.checkpoint_dir(ctx.run.ckpt).exists():
        ctx.residency.before_trainer(training=False)
        ctx.residency.reload_trainer(trainer)
        trainer.save(ctx.run.ckpt)


def train(ctx: StepContext) -> None:
    """Train on this step's shard; the new policy version goes to state.policy_version."""
    state, settings = ctx.state, ctx.settings
    if is_resident(settings):
        _train_resident(ctx)
        check_align_gate(ctx)
        return
    newest = newest_checkpoint_version(ctx.run)
    if newest is None or newest <= state.policy_version:
        load = train_load_path(ctx.run, state.policy_version,
                               initial=initial_weights(settings))
        cfg = settings.train_config(ctx.run, step=state.step, load=str(load))
        atomic.remove_stale_temporaries(ctx.run.ckpt)
        if settings.loop.placement == "colocated":
            ctx.residency.release_engines()
        if settings.loop.launcher == "ray":
            ctx.engines.run_trainer(cfg)  # rltool.loop.ray_launcher.RayPlacement
        else:
            _train_subprocess(ctx, cfg)
        newest = newest_checkpoint_version(ctx.run)
        if newest is None or newest <= state.policy_version:
            raise EngineError(f"the trainer finished without a checkpoint newer than version "
                              f"{state.policy_version} in {ctx.run.ckpt}")
    state.base_version = state.policy_version  # the engines' version: the delta's base
    state.policy_version = newest
    check_align_gate(ctx)


def _train_subprocess(ctx: StepContext, cfg: Any) -> None:
    import tomli_w

    from rltool.supervisor import log_tail

    config_file = ctx.run.train_config(ctx.state.step)
    atomic.write_text(config_file, tomli_w.dumps(
        {"train": cfg.model_dump(mode="json", exclude_none=True)}))
    log_path = ctx.run.log_file("trainer")
    code, _ = TrainerProcess(ctx.registry, config_file=config_file, log_path=log_path,
                             launcher=ctx.settings.loop.trainer_launcher).run()
    if code != 0:
        raise EngineError(f"the trainer exited with code {code} at step {ctx.state.step}; log "
                          f"{log_path} ends with:\n{log_tail(log_path)}")


def train_metrics(run: RunDir, step: int) -> dict[str, Any]:
    """The last train.jsonl row of this loop step (the trainer tags rows with rollout_step)."""
    rows = [r for r in read_metrics(run.metrics_file("train")) if r.get("rollout_step") == step]
    return rows[-1] if rows else {}


def check_align_gate(ctx: StepContext) -> None:
    tol = ctx.settings.loop.align_gate
    if tol is None:
        return
    value = train_metrics(ctx.run, ctx.state.step).get(ALIGN_METRIC)
    if value is None:
        raise GateFailedError(f"--align-gate {tol}: the trainer logged no {ALIGN_METRIC} for "
                              f"step {ctx.state.step}")
    if value > tol:
        raise GateFailedError(
            f"--align-gate {tol}: step {ctx.state.step} has {ALIGN_METRIC} = {value:.3g} > {tol:g}"
            " (engine and trainer logprobs disagree); check dtypes/--deterministic, inspect with "
            f"`rltool align-gate --rollouts {ctx.run.rollout_step(ctx.state.step)} --weights "
            f"{ctx.run.weight_version(max(ctx.state.policy_version - 1, 0))}`")


def publish(ctx: StepContext) -> None:
    from rltool.delta.publish import decide_transport, publish_version
    from rltool.train.checkpoint import MODEL_DIR

    settings, state = ctx.settings, ctx.state
    version = state.policy_version
    out = ctx.run.weight_version(version)
    if out.exists():
        state.publish = state.publish or {"sync/mode": version_mode(out)}
        if sync_mode(settings) != "disk":
            state.publish["sync/mode"] = sync_mode(settings)
        return
    to_disk = is_save_step(settings, state.step)
    if lora_sync.is_adapter_run(settings):
        _publish_adapter(ctx, to_disk=to_disk)
        return
    if is_resident(settings):
        trainer = resident_trainer(ctx)
        # An in-memory version off the save steps writes nothing: no host copy of the weights.
        writes = to_disk or decide_transport(settings.sync,
                                             in_memory=in_memory_transport(settings)) is None
        src: Any = dict(trainer.named_tensors()) if writes else {}
        kwargs: dict[str, Any] = {"source_model_dir": trainer.model_dir,
                                  "dtype": settings.train_config(
                                      ctx.run, step=state.step, load=settings.model.path).dtype}
    else:
        src, kwargs = ctx.run.ckpt_step(version) / MODEL_DIR, {}
    result = publish_version(src, settings.sync, publish_dir=ctx.run.weights, version=version,
                             base_version=state.base_version,
                             in_memory=in_memory_transport(settings), to_disk=to_disk,
                             **kwargs)
    state.publish = {k: v for k, v in result.items() if isinstance(v, (int, float, str))}


def _publish_adapter(ctx: StepContext, *, to_disk: bool) -> None:
    """A LoRA version: the resident trainer's adapter, or the adapter/ of the disaggregated
    trainer's checkpoint (rltool.loop.lora_sync)."""
    from rltool.train.checkpoint import ADAPTER_DIR

    settings, state = ctx.settings, ctx.state
    version = state.policy_version
    src: Any = (resident_trainer(ctx) if is_resident(settings)
                else ctx.run.ckpt_step(version) / ADAPTER_DIR)
    dtype = settings.train_config(ctx.run, step=state.step, load=settings.model.path).dtype
    result = lora_sync.publish(src, settings, publish_dir=ctx.run.weights, version=version,
                               base_version=state.base_version,
                               in_memory=in_memory_transport(settings), to_disk=to_disk,
                               dtype=dtype)
    state.publish = {k: v for k, v in result.items() if isinstance(v, (int, float, str))}


def version_mode(path: Path) -> str:
    from rltool.io.checkpoint import is_delta_dir

    return "delta" if is_delta_dir(path) else "full"


def sync(ctx: StepContext) -> float:
    version = ctx.state.policy_version
    mode = sync_mode(ctx.settings)
    if mode != "disk":
        return push_weights(ctx, mode)
    ctx.residency.for_engines(ctx.trainer)
    return ctx.engines.load_version(version, delta=version_mode(ctx.run.weight_version(version))
                                    == "delta")


def push_weights(ctx: StepContext, mode: str) -> float:
    """Hand the resident trainer's weights to every engine in memory as state.policy_version
    (on CUDA colocated: staged on the host, the trainer offloaded, the engines resumed first)."""
    import torch

    from rltool.delta import tensor_sync
    from rltool.delta.publish import FP8_BLOCK

    bucket_bytes = ctx.settings.sync.tensor_bucket_mb << 20
    if lora_sync.is_adapter_run(ctx.settings):  # the adapter alone: the base never moves
        trainer = resident_trainer(ctx)
        named = lora_sync.engine_tensors(trainer)
        ctx.residency.for_engines(trainer)
        if ctx.settings.sync.precision == "bf16":  # bf16 values, in the engines' dtype
            named = [(n, t.to(torch.bfloat16)) for n, t in named]
        ctx.state.publish["perf/update_weights_wire_bytes"] = lora_sync.tensor_bytes(
            named, ctx.engines.dtype)
        load = ctx.engines.load_tensors if mode == "tensor" else ctx.engines.load_distributed
        return load(named, version=ctx.state.policy_version, bucket_bytes=bucket_bytes,
                    lora_config=lora_sync.tensor_config(ctx.settings))
    named = ctx.residency.engine_weights(resident_trainer(ctx), ctx.engines.dtype)
    if ctx.settings.sync.precision == "bf16":  # bf16 values, whatever dtype the engines hold
        named = [(n, t.to(torch.bfloat16)) for n, t in named]
    if mode == "tensor" and ctx.settings.sync.precision == "fp8":
        t0 = time.perf_counter()
        named = tensor_sync.quantize_named(named, dtype=ctx.engines.dtype, block=FP8_BLOCK)
        quantize_s = time.perf_counter() - t0
        return quantize_s + ctx.engines.load_tensors(
            named, version=ctx.state.policy_version, bucket_bytes=bucket_bytes, block=FP8_BLOCK)
    if mode == "tensor" and ctx.settings.sync.precision == "int4":  # INT4 tensors, as stored
        from rltool.delta.publish import int4_format

        t0 = time.perf_counter()
        named = tensor_sync.quantize_named_int4(named, dtype=ctx.engines.dtype,
                                                fmt=int4_format(ctx.settings.model.path))
        quantize_s = time.perf_counter() - t0
        return quantize_s + ctx.engines.load_tensors(
            named, version=ctx.state.policy_version, bucket_bytes=bucket_bytes)
    load = ctx.engines.load_tensors if mode == "tensor" else ctx.engines.load_distributed
    return load(named, version=ctx.state.policy_version, bucket_bytes=bucket_bytes)


def evaluate(ctx: StepContext) -> dict[str, Any]:
    from rltool.data.shards import MANIFEST
    from rltool.rollout.eval import run as run_eval

    out = ctx.run.eval_step(ctx.state.step)
    if not (out / MANIFEST).exists():
        ctx.residency.for_engines(ctx.trainer)
        atomic.remove_stale_temporaries(ctx.run.eval)
        run_eval(ctx.settings.eval_config(ctx.run, step=ctx.state.step, urls=ctx.engines.urls,
                                          policy_version=ctx.state.policy_version),
                 clients=ctx.engines.clients)
    return eval_metrics(ctx.run, ctx.state.step)


def eval_metrics(run: RunDir, step: int) -> dict[str, Any]:
    """The step's eval.jsonl row ({} when it has none): what the step's loop.jsonl row carries,
    read back the same way whether the eval ran now or before a resume."""
    rows = [r for r in read_metrics(run.metrics_file("eval")) if r.get("step") == step]
    return rows[-1] if rows else {}


def rollout_summary(run: RunDir, step: int) -> dict[str, float]:
    """Reward and response length of this step's shard, read from the shard itself (so a resumed
    step reports the same numbers whether or not its rollout.jsonl line was written)."""
    from rltool.data.shards import open_shard

    rewards: list[float] = []
    lengths: list[int] = []
    for batch in open_shard(run.rollout_step(step)).iter_batches(
            columns=["reward", "response_token_ids"]):
        rewards.extend(batch.column("reward").to_pylist())
        lengths.extend(len(x) for x in batch.column("response_token_ids").to_pylist())
    n = max(len(rewards), 1)
    return {"rollout/raw_reward": sum(rewards) / n, "rollout/response_len/mean": sum(lengths) / n,
            "rollout/num_samples": len(rewards)}


def timed(fn: Any, ctx: StepContext, *, name: str | None = None) -> tuple[Any, float]:
    """Run one phase: its seconds, its CPU seconds in ctx.cpu_seconds[name] (default: the
    function's name) and its peak device memory in ctx.memory."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    ctx.memory.start()
    with trace.span(fn.__name__, cat="phase", step=ctx.state.step):
        result = fn(ctx)
    ctx.memory.stop(fn.__name__)
    ctx.cpu_seconds[name or fn.__name__] = time.process_time() - cpu0
    return result, time.perf_counter() - t0
