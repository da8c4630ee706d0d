"""`rltool loop --mode async`: the steps of the fully asynchronous loop.

The engines generate all the time (async_rollout.RolloutStream, in the rollout worker process
async_worker.py, next to the engines);
the resident trainer (phases.resident_trainer, the loop's main thread) takes the next batch of
`rollout_batch_size` finished groups as soon as they are ready, and each new version reaches the
engines in flight (pause in the update mode, load with the run's sync mode, continue). Evaluation
runs on its own engine and thread (async_eval.EvalWorker).

A step records the same phases as the synchronous loop, so state.json, resume and the kill points
(`RLTOOL_KILL_AT=loop.PHASE:N`, `loop.start:N`) work the same way:
rollout  -> RUN/rollouts/step-K/: the batch, taken and written by the rollout worker while the
            trainer trained step K-1 (the first step waits for it); its metadata
            (`extra.async`) records the positions started but not taken (`held`), the next fresh
            position, the positions dropped as too stale, and the step's staleness metrics;
train, publish, sync -> as in the synchronous loop (sync: pause, load, continue).
After a kill, a shard written ahead of the step in progress is discarded (its samples are not yet
committed), the held positions of the newest remaining shard are generated again from their
prompts (their partial or finished samples were never written) and counted as
`resume/regenerated_groups`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict
from collections.abc import Callable
from typing import Any

from rltool import trace
from rltool.data.shards import MANIFEST
from rltool.faults import kill_point
from rltool.loop import lora_sync, phases
from rltool.loop.async_eval import EvalWorker
from rltool.loop.async_staleness import StalenessGate
from rltool.loop.async_worker import RolloutWorker
from rltool.loop.engines import EngineSet
from rltool.rundir import (MetricsWriter, RunDir, drop_metric_rows_after, list_versions,
                           read_metrics)

log = logging.getLogger(__name__)
ENGINE_PAUSE_MODE = {"in-place": "in_place", "retract": "retract", "abort": "abort"}
UPDATE_KEYS = {"in-place": "update/kept_in_place", "retract": "update/retracted",
               "abort": "update/aborted"}


def shard_async_meta(ctx: phases.StepContext, step: int) -> dict[str, Any]:
    from rltool.data.shards import open_shard

    return open_shard(ctx.run.rollout_step(step)).meta.extra.get("async", {})


def discard_prepared(run: RunDir, step: int) -> None:
    """Remove the shards of steps after `step`: written ahead by a worker that was killed with
    the loop, they are not committed (their positions are held or fresh in the newest shard up
    to `step`, and are generated again). One rename each, then the removal; then their lines in
    the rollout metrics, so the batches generated again are the only rows of their steps."""
    after = step + 1
    while run.rollout_step(after).exists():
        path = run.rollout_step(after)
        gone = path.with_name(f".{path.name}.discarded.tmp")
        os.rename(path, gone)
        shutil.rmtree(gone)
        after += 1
    drop_metric_rows_after(run.metrics_file("rollout"), step)


def resume_positions(ctx: phases.StepContext) -> tuple[int, list[int]]:
    """(next fresh position, positions to generate again) from the newest written batch."""
    step = ctx.state.step
    while step >= 0 and not (ctx.run.rollout_step(step) / MANIFEST).exists():
        step -= 1
    if step < 0:
        return 0, []
    meta = shard_async_meta(ctx, step)
    return int(meta.get("next_position", 0)), [int(p) for p in meta.get("held", [])]


def run_steps(ctx: phases.StepContext, *, writer: MetricsWriter,
              step_metrics: Callable[..., dict[str, Any]],
              on_step: Callable[[dict[str, Any]], None] | None,
              stop_when: Callable[[list[dict[str, Any]]], bool] | None) -> bool:
    """Run the remaining steps asynchronously; True when `stop_when` ended the run early."""
    run, settings, state = ctx.run, ctx.settings, ctx.state
    from rltool.train.step import optimizer_steps

    phases.resident_trainer(ctx)  # rebuilt and replayed before anything generates
    discard_prepared(run, state.step)
    mode = phases.sync_mode(settings)
    cfg = settings.rollout_config(run, step=state.step, urls=ctx.engines.urls)
    if (run.rollout_step(state.step) / MANIFEST).exists():
        cfg = settings.rollout_config(run, step=state.step + 1, urls=ctx.engines.urls)
    train_cfg = settings.train_config(run, step=state.step, load=settings.model.path)
    batch = cfg.rollout_batch_size
    gate = StalenessGate(max_staleness=settings.loop.max_staleness, batch_groups=batch,
                         versions_per_step=optimizer_steps(
                             train_cfg, batch * cfg.n_samples_per_prompt))
    engine_version = state.policy_version if mode != "disk" else \
        max(list_versions(run.weights), default=0)
    next_position, redo = resume_positions(ctx)
    evaluator = _start_evaluator(ctx, mode)
    stream = RolloutWorker(ctx.registry, log_path=run.log_file("rollout"), init={
        "rollout": cfg.model_dump(mode="json"), "gate": asdict(gate),
        "engine_version": engine_version, "trainer_version": state.policy_version,
        "next_position": next_position, "redo": redo, "cores": settings.loop.engine_cores})
    stopped = False
    regenerated = len(redo)
    try:
        while state.step < settings.loop.num_steps and not stopped:
            with trace.span("step", cat="step", step=state.step):
                row = _step(ctx, stream, evaluator, mode=mode, writer=writer,
                            step_metrics=step_metrics, versions_per_step=gate.versions_per_step,
                            extra={"resume/regenerated_groups": regenerated} if regenerated
                            else {})
            regenerated = 0
            if on_step is not None:
                on_step(row)
            state.next_step(run)
            stopped = stop_when is not None and stop_when(read_metrics(writer.path))
        stream.stop()
        if evaluator is not None:
            evaluator.finish()
    finally:
        stream.stop()
        if evaluator is not None:
            evaluator.engine.stop()
    return stopped


def _start_evaluator(ctx: phases.StepContext, mode: str) -> EvalWorker | None:
    loop = ctx.settings.loop
    if ctx.settings.eval is None or loop.eval_interval is None:
        return None
    engine = EngineSet(ctx.run, ctx.registry, num_engines=1,
                       engine_args=ctx.settings.engine_args(), deterministic=loop.deterministic,
                       ready_timeout_s=loop.engine_ready_timeout_s, log_prefix="eval-engine",
                       api_key=loop.api_key, admin_api_key=loop.admin_api_key,
                       local_weights=ctx.run.eval_local_weights)
    worker = EvalWorker(ctx.run, ctx.settings, engine, mode=mode)
    worker.start()
    return worker


def _send_versions(stream: RolloutWorker, version: int) -> None:
    """The new version to the worker; its answer (the aborted samples it requeued since the
    last one) is read when the step is recorded."""
    stream.send({"op": "set_versions", "trainer_version": version, "engine_version": version})


def _batch_request(ctx: phases.StepContext, step: int, train_version: int) -> dict[str, Any]:
    cfg = ctx.settings.rollout_config(ctx.run, step=step, urls=ctx.engines.urls)
    return {"rollout": cfg.model_dump(mode="json"), "train_version": train_version}


def _step(ctx: phases.StepContext, stream: RolloutWorker, evaluator: EvalWorker | None, *,
          mode: str, writer: MetricsWriter, step_metrics: Callable[..., dict[str, Any]],
          versions_per_step: int, extra: dict[str, Any]) -> dict[str, Any]:
    state, run, settings = ctx.state, ctx.run, ctx.settings
    kill_point("loop.start")
    t_step = time.perf_counter()
    if not state.completed("rollout"):
        seconds = 0.0
        # A shard the worker prepares may already be written: take it from the worker anyway
        # (that also asks for the next one); one written before a restart is just used.
        if stream.prepared_step == state.step or \
                not (run.rollout_step(state.step) / MANIFEST).exists():
            following = state.step + 1 < settings.loop.num_steps
            with trace.span("rollout", cat="phase", step=state.step):
                seconds = stream.call({
                    "op": "take", **_batch_request(ctx, state.step, state.policy_version),
                    "next": _batch_request(ctx, state.step + 1,
                                           state.policy_version + versions_per_step)
                    if following else None})["seconds"]
            stream.prepared_step = state.step + 1 if following else None
        state.done(run, "rollout", seconds=seconds)
    for name, fn in (("train", phases.train), ("publish", phases.publish)):
        if not state.completed(name):
            _, seconds = phases.timed(fn, ctx)
            state.done(run, name, seconds=seconds)
    if not state.completed("sync"):
        update_mode = settings.loop.update_mode
        t0 = time.perf_counter()
        with trace.span("sync", cat="phase", step=state.step, update_mode=update_mode):
            stream.send({"op": "in_flight"})  # counted by the worker while the engines pause
            ctx.engines.pause(ENGINE_PAUSE_MODE[update_mode])
            try:
                phases.sync(ctx)
            finally:
                ctx.engines.continue_generation()
            state.publish[UPDATE_KEYS[update_mode]] = stream.receive()["samples"]
            _send_versions(stream, state.policy_version)
        state.done(run, "sync", seconds=time.perf_counter() - t0)
    else:
        _send_versions(stream, state.policy_version)
    if evaluator is not None and settings.is_eval_step(state.step):
        evaluator.submit(state.policy_version, lora_sync.policy_tensors(
            phases.resident_trainer(ctx), settings) if mode != "disk" else None)
    with trace.span("record", cat="phase", step=state.step):
        row = step_metrics(ctx, eval_row={}, wall_s=time.perf_counter() - t_step)
        row.update(shard_async_meta(ctx, state.step).get("metrics", {}))
        for key in UPDATE_KEYS.values():
            if key in state.publish:
                row[key] = state.publish[key]
        row["update/requeued"] = stream.receive()["requeued"]
        row.update(extra)
        if not any(r.get("step") == state.step for r in read_metrics(writer.path)):
            row = writer.log(row, step=state.step, policy_version=state.policy_version)
    return row
