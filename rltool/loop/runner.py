"""`rltool loop` as a library: `start(settings, run_dir)` for a new run, `resume(run_dir)` for a
killed one; both drive `run_steps`, which walks the phases of each step (phases.py), records them
in state.json (state.py) and writes one loop.jsonl line per step.

Children (engines, the disaggregated trainer) are recorded in engines.json and ended by PID when
the loop returns, fails or is interrupted (Ctrl-C / SIGTERM reach `finally`); after a SIGKILL,
`resume` ends the orphans it finds in engines.json before starting fresh engines.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rltool import atomic, trace, tracking
from rltool.errors import BadInputError
from rltool.faults import kill_point
from rltool.loop import phases
from rltool.loop.affinity import pin, pin_tree
from rltool.loop.config import LoopSettings
from rltool.loop.engines import ChildRegistry, EngineSet, end_orphans
from rltool.loop.state import LoopState
from rltool.rundir import MetricsWriter, RunDir, list_versions, read_metrics

log = logging.getLogger(__name__)
StepCallback = Callable[[dict[str, Any]], None]
# Called with the metrics rows so far after each step; True ends the run early (status "stopped").
StopRule = Callable[[list[dict[str, Any]]], bool]
GC_YOUNG_ALLOCATIONS = 20_000  # the step loop's first garbage-collector threshold (see below)


def start(settings: LoopSettings, run_dir: str | Path, *,
          on_step: StepCallback | None = None, stop_when: StopRule | None = None
          ) -> dict[str, Any]:
    """Create RUN (refused if it already holds a run), publish version 0 and run every step."""
    run = RunDir(run_dir)
    if run.state.exists() or run.config.exists():
        raise BadInputError(f"{run.root} already holds a run; continue it with "
                            f"`rltool loop --resume {run.root}` or choose a new --run-dir")
    if run.root.exists() and any(run.root.iterdir()):
        raise BadInputError(f"--run-dir {run.root} exists and is not empty; choose a new one")
    _check_prompts(settings)
    if settings.loop.external:  # refuse engines that cannot serve this run before writing
        from rltool.loop.external import check_engines

        check_engines(run, settings, mode=phases.sync_mode(settings))
    import tomli_w

    run.create()
    atomic.write_text(run.config, tomli_w.dumps(settings.to_tables()))
    return _run(run, settings, on_step=on_step, stop_when=stop_when)


def resume(run_dir: str | Path, *, overrides: dict[str, dict[str, Any]] | None = None,
           on_step: StepCallback | None = None) -> dict[str, Any]:
    """Continue a run from state.json after ending the children a killed loop left behind."""
    run = RunDir(run_dir)
    if not run.config.exists():
        raise BadInputError(f"--resume {run.root}: no config.toml; not a loop run directory")
    settings = LoopSettings.from_file(run.config, overrides=overrides)
    _check_prompts(settings)
    ended = end_orphans(run)
    if ended:
        log.info("ended %d orphaned child process(es): %s", len(ended), ended)
    if overrides:
        import tomli_w

        atomic.write_text(run.config, tomli_w.dumps(settings.to_tables()))
    return _run(run, settings, on_step=on_step)


def _check_prompts(settings: LoopSettings) -> None:
    """Read the rollout and eval prompt files before anything is written: a bad file is refused
    (BadInputError) with the run directory and its config.toml untouched."""
    from rltool.rollout.prompts import cached_prompts

    for cfg in (settings.rollout, settings.eval):
        if cfg is not None:
            cached_prompts(cfg.prompts, cfg.prompt_keys())


def _initial_weights(run: RunDir, settings: LoopSettings) -> None:
    from rltool.delta.publish import publish_version

    if not run.weight_version(0).exists():
        atomic.remove_stale_temporaries(run.weights)
        publish_version(settings.model.path, settings.sync, publish_dir=run.weights, version=0)


def _run(run: RunDir, settings: LoopSettings, *, on_step: StepCallback | None,
         stop_when: StopRule | None = None) -> dict[str, Any]:
    run.create()
    trace.configure(run.trace, role="loop")
    _initial_weights(run, settings)
    state = LoopState.load(run) or LoopState()
    state.num_steps = settings.loop.num_steps
    state.status = "running"
    state.save(run)
    registry = ChildRegistry(run)
    engines = _engines(run, registry, settings)
    ctx = phases.StepContext(run=run, settings=settings, engines=engines, registry=registry,
                             state=state)
    mirror = tracking.open_mirror(settings.loop, run, from_step=state.step,
                                  config=settings.to_tables())
    t_start = time.perf_counter()
    gc_thresholds: tuple[int, ...] | None = None  # set once _freeze_long_lived ran
    if settings.loop.trainer_cores:
        pin(os.getpid(), settings.loop.trainer_cores)
    try:
        engines.start(run.weight_version(0))
        if settings.loop.engine_cores:
            for proc in engines.procs:
                pin_tree(proc.pid, settings.loop.engine_cores)
        mode = phases.sync_mode(settings)
        served = max(list_versions(run.weights), default=0)
        if mode != "disk" and state.policy_version > 0:
            # A resumed run with in-memory sync: the rebuilt trainer hands over its policy.
            phases.push_weights(ctx, mode)
        elif served > 0:  # a resumed run: serve the newest published policy
            engines.load_version(served, delta=phases.version_mode(run.weight_version(served))
                                 == "delta")
        with MetricsWriter(run.metrics_file("loop")) as writer:
            stopped = False
            if settings.loop.mode == "async":
                from rltool.loop.async_runner import run_steps

                def after_step(row: dict[str, Any]) -> None:
                    if mirror is not None:
                        mirror.poll()
                    if on_step is not None:
                        on_step(row)

                stopped = run_steps(ctx, writer=writer, step_metrics=step_metrics,
                                    on_step=after_step, stop_when=stop_when)
            while state.step < settings.loop.num_steps and not stopped:
                with trace.span("step", cat="step", step=state.step):
                    run_step(ctx, writer=writer, on_step=on_step)
                if mirror is not None:
                    mirror.poll()
                stopped = stop_when is not None and stop_when(read_metrics(writer.path))
                if gc_thresholds is None and not gc.get_freeze_count():  # else the caller's
                    gc_thresholds = _freeze_long_lived()
        if phases.is_resident(settings):
            phases.save_resident(ctx)  # the end is always a checkpoint, also when stopped early
        state.status = "stopped" if stopped else "done"
        state.save(run)
    except BaseException:
        state.status = "failed"
        state.save(run)
        raise
    finally:
        if gc_thresholds is not None:
            gc.unfreeze()
            gc.set_threshold(*gc_thresholds)
        engines.stop()
        if mirror is not None:
            mirror.tracker.close()
        trace.configure(None, role="loop")
    return {"run_dir": str(run.root), "steps": state.step, "policy_version": state.policy_version,
            "elapsed_s": time.perf_counter() - t_start,
            "metrics": str(run.metrics_file("loop"))}


def _freeze_long_lived() -> tuple[int, ...]:
    """After the first step (which builds the resident trainer): collect once, then keep what is
    left (models, engine, imported modules: most of the process's objects, alive for the whole
    run) out of later collections, and collect the young generation every 20,000 allocations
    instead of 700. A full collection walked all of it again every ~10 steps (0.15-0.3 s each
    on the demo; 2-5 ms frozen), the young ones 7-9 ms per step (3 ms). Returns the thresholds
    to restore: the loop unfreezes and restores them when it returns (a library caller goes on).
    """
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_ALLOCATIONS, *before[1:])
    return before


def _engines(run: RunDir, registry: ChildRegistry, settings: LoopSettings) -> EngineSet:
    """The engines the loop starts (as children, in Ray actors: rltool.loop.ray_launcher, or on
    a thread of its own process: rltool.loop.local_engine), or the external ones it drives
    (rltool.loop.external)."""
    if settings.loop.launcher == "ray":
        from rltool.loop.ray_launcher import RayPlacement

        return RayPlacement(run, registry, settings)
    if settings.loop.external:
        from rltool.loop.external import ExternalEngines

        return ExternalEngines(run, registry, settings, mode=phases.sync_mode(settings))
    if settings.loop.engine == "inprocess":
        from rltool.loop.local_engine import InProcessEngines

        return InProcessEngines(run, registry, serve_config=settings.serve_config(
            run.weight_version(0)), ready_timeout_s=settings.loop.engine_ready_timeout_s)
    return EngineSet(run, registry, num_engines=settings.loop.num_engines,
                     engine_args=settings.engine_args(),
                     deterministic=settings.loop.deterministic,
                     ready_timeout_s=settings.loop.engine_ready_timeout_s,
                     api_key=settings.loop.api_key, admin_api_key=settings.loop.admin_api_key)


def run_step(ctx: phases.StepContext, *, writer: MetricsWriter,
             on_step: StepCallback | None = None) -> dict[str, Any]:
    """Run the phases of ctx.state.step that are not recorded yet, then log and advance."""
    state, run = ctx.state, ctx.run
    kill_point("loop.start")  # before the step's first phase (state.done kills after each)
    t_step = time.perf_counter()
    ctx.residency.seconds, ctx.memory.row, ctx.cpu_seconds = {}, {}, {}
    for name, fn in (("rollout", phases.rollout), ("train", phases.train),
                     ("publish", phases.publish)):
        if not state.completed(name):
            _, seconds = phases.timed(fn, ctx)
            state.done(run, name, seconds=seconds)
    if not state.completed("sync"):
        _, seconds = phases.timed(phases.sync, ctx)
        state.done(run, "sync", seconds=seconds)
    eval_row: dict[str, Any] = {}
    if ctx.settings.is_eval_step(state.step):
        if state.completed("eval"):  # recorded before a resume: its row is in eval.jsonl
            eval_row = phases.eval_metrics(run, state.step)
        else:
            eval_row, seconds = phases.timed(phases.evaluate, ctx, name="eval")
            state.done(run, "eval", seconds=seconds)
    with trace.span("record", cat="phase", step=state.step):
        row = step_metrics(ctx, eval_row=eval_row, wall_s=time.perf_counter() - t_step)
        if not any(r.get("step") == state.step for r in read_metrics(writer.path)):
            row = writer.log(row, step=state.step, policy_version=state.policy_version)
    if on_step is not None:
        on_step(row)
    state.next_step(run)
    return row


def step_metrics(ctx: phases.StepContext, *, eval_row: dict[str, Any],
                 wall_s: float) -> dict[str, Any]:
    state = ctx.state
    train = phases.train_metrics(ctx.run, state.step)
    row: dict[str, Any] = dict(phases.rollout_summary(ctx.run, state.step))
    for key in ("train/train_rollout_logprob_abs_diff", "train/ppo_kl", "train/kl_loss",
                "train/pg_loss", "train/pg_clipfrac", "train/entropy_loss", "train/grad_norm",
                "train/failed_groups_left_out"):
        if key in train:
            row[key] = train[key]
    for name, seconds in state.phase_times.items():
        row[f"perf/loop/{name}_time"] = seconds
    row["perf/loop/step_time"] = sum(state.phase_times.values())
    for name, seconds in ctx.cpu_seconds.items():  # the phases this process ran this step
        row[f"perf/loop/{name}_cpu_time"] = seconds
    row["perf/loop/wall_time"] = wall_s
    # Device hand-overs inside the phases above (CUDA colocated: rltool.loop.colocation).
    for name, seconds in ctx.residency.seconds.items():
        row[f"perf/loop/{name}_time"] = seconds
    row.update(ctx.memory.row)
    for key in ("sync/mode", "sync/precision", "perf/update_weights_wire_bytes",
                "perf/update_weights_density"):
        if key in state.publish:
            row[key] = state.publish[key]
    for key in ("eval/mean_reward", "eval/pass@1", "eval/pass@k"):
        if key in eval_row:
            row[key] = eval_row[key]
    return row
