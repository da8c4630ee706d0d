"""The phases of one synchronous step, each a function of a `StepContext`:

rollout  -> RUN/rollouts/step-K/ (shard, `_SUCCESS`), metrics/rollout.jsonl
train    -> RUN/train/ckpt/step-V/ (`trainer_state.json`), metrics/train.jsonl
publish  -> RUN/weights/weight_vV/ (full or delta, rltool.delta.publish.publish_version)
sync     -> every engine serves version V (pull for a delta, then /update_weights_from_disk)
eval     -> RUN/eval/step-K/ (shard), metrics/eval.jsonl, every `eval_interval` steps

Each phase first checks its artifact's marker, so a phase that completed before a kill (even one
not yet recorded in state.json) is not redone, and nothing is duplicated.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltool import atomic, trace
from rltool.errors import EngineError, GateFailedError
from rltool.loop.config import LoopSettings
from rltool.loop.engines import ChildRegistry, EngineSet, TrainerProcess
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


def rollout(ctx: StepContext) -> None:
    from rltool.data.shards import MANIFEST
    from rltool.rollout.stage import run as run_rollout

    out = ctx.run.rollout_step(ctx.state.step)
    if (out / MANIFEST).exists():
        return
    atomic.remove_stale_temporaries(ctx.run.rollouts)
    run_rollout(ctx.settings.rollout_config(ctx.run, step=ctx.state.step, urls=ctx.engines.urls))


def newest_checkpoint_version(run: RunDir) -> int | None:
    from rltool.train.checkpoint import STATE_FILE
    from rltool.rundir import parse_step_dir_name

    if not run.ckpt.is_dir():
        return None
    versions = [v for p in run.ckpt.iterdir()
                if (v := parse_step_dir_name(p.name)) is not None and (p / STATE_FILE).exists()]
    return max(versions, default=None)


def train_load_path(run: RunDir, version: int) -> Path:
    """What the trainer resumes from: the checkpoint that produced `version`, else the initial
    weights (version 0 has no checkpoint)."""
    ckpt = run.ckpt_step(version)
    return ckpt if version > 0 and ckpt.exists() else run.weight_version(0)


def train(ctx: StepContext) -> None:
    """Train on this step's shard; the new policy version goes to state.policy_version."""
    state, settings = ctx.state, ctx.settings
    newest = newest_checkpoint_version(ctx.run)
    if newest is None or newest <= state.policy_version:
        load = train_load_path(ctx.run, state.policy_version)
        cfg = settings.train_config(ctx.run, step=state.step, load=str(load))
        atomic.remove_stale_temporaries(ctx.run.ckpt)
        if settings.loop.placement == "colocated":
            ctx.engines.release_memory()
            from rltool.train import run as run_train

            run_train(cfg)
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

    config_file = ctx.run.root / "train" / f"step-{ctx.state.step:06d}.toml"
    atomic.write_text(config_file, tomli_w.dumps(
        {"train": cfg.model_dump(mode="json", exclude_none=True)}))
    log_path = ctx.run.log_file("trainer")
    code, _ = TrainerProcess(ctx.registry, config_file=config_file, log_path=log_path).run()
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
    from rltool.delta.publish import publish_version
    from rltool.train.checkpoint import MODEL_DIR

    version = ctx.state.policy_version
    out = ctx.run.weight_version(version)
    if out.exists():
        ctx.state.publish = ctx.state.publish or {"sync/mode": version_mode(out)}
        return
    result = publish_version(ctx.run.ckpt_step(version) / MODEL_DIR, ctx.settings.sync,
                             publish_dir=ctx.run.weights, version=version,
                             base_version=ctx.state.base_version)
    ctx.state.publish = {k: v for k, v in result.items() if isinstance(v, (int, float, str))}


def version_mode(path: Path) -> str:
    from rltool.io.checkpoint import is_delta_dir

    return "delta" if is_delta_dir(path) else "full"


def sync(ctx: StepContext) -> float:
    version = ctx.state.policy_version
    if ctx.settings.loop.placement == "colocated":
        ctx.engines.resume_memory()
    return ctx.engines.load_version(version, delta=version_mode(ctx.run.weight_version(version))
                                    == "delta")


def evaluate(ctx: StepContext) -> dict[str, Any]:
    from rltool.data.shards import MANIFEST
    from rltool.rollout.eval import run as run_eval

    out = ctx.run.eval_step(ctx.state.step)
    if not (out / MANIFEST).exists():
        atomic.remove_stale_temporaries(ctx.run.eval)
        run_eval(ctx.settings.eval_config(ctx.run, step=ctx.state.step, urls=ctx.engines.urls,
                                          policy_version=ctx.state.policy_version))
    rows = [r for r in read_metrics(ctx.run.metrics_file("eval")) if r.get("step") ==
            ctx.state.step]
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


def timed(fn: Any, ctx: StepContext) -> tuple[Any, float]:
    t0 = time.perf_counter()
    with trace.span(fn.__name__, cat="phase", step=ctx.state.step):
        result = fn(ctx)
    return result, time.perf_counter() - t0
