"""What the demo's recipes share (rltool.demo: the copy task on CPU; rltool.demo_gpu: addition
or reversal, the GPU demo): the step table, the summary, the demo directory, the clock and the
chunked supervised warm start."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from rltool.errors import BadInputError
from rltool.rundir import parse_step_dir_name, parse_weight_dir_name

MARKER = ".rltool-demo"  # only a directory carrying this marker is ever deleted by the demo
TARGET = 0.8
WINDOW = 5  # the demo stops once the mean rollout reward of the last WINDOW steps reaches TARGET


class Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.t0_wall = time.time()

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {text}", flush=True)



def chunked_warm_start(root: Path, model: Path, *, first_steps: int, chunk_steps: int,
                       max_steps: int, config: Callable[..., Any],
                       done: Callable[[list[float]], bool]) -> tuple[Path, int, list[float]]:
    """Supervised steps: `first_steps`, then `chunk_steps` more at a time, each call resuming
    from the checkpoint in DIR/sft/ckpt, until `done(sft losses so far)` or `max_steps` in all.
    `config(load=, save=, num_steps=, first=)` builds each call's TrainConfig; each call's
    checkpoint and weights replace the previous call's on disk. Returns the published weights,
    the steps trained and the per-step losses."""
    from rltool.train import run as run_train

    save, losses, load = str(root / "sft" / "ckpt"), [], str(model)
    steps = chunk = min(first_steps, max_steps)
    while True:  # a call on a finished checkpoint trains `chunk` more steps from it
        result = run_train(config(load=load, save=save, num_steps=chunk, first=load == str(model)))
        _keep_newest(root / "sft" / "ckpt", parse_step_dir_name)  # the next call resumes it;
        _keep_newest(root / "sft" / "weights", parse_weight_dir_name)  # (0.5B: ~4 GB each)
        losses += [m["train/sft_loss"] for m in result.metrics if "train/sft_loss" in m]
        if done(losses) or steps >= max_steps:
            break
        chunk, load = min(chunk_steps, max_steps - steps), save
        steps += chunk
    assert result.published is not None
    return Path(result.published), steps, losses


def _keep_newest(parent: Path, parse: Callable[[str], int | None]) -> None:
    """Delete every numbered directory in `parent` (a checkpoint step, a weight version) but the
    newest: the warm start's earlier chunks are superseded by the one that resumed them."""
    numbered = sorted((n, d) for d in parent.iterdir() if (n := parse(d.name)) is not None)
    for _, old in numbered[:-1]:
        shutil.rmtree(old)


def window_mean(values: list[float], window: int = WINDOW) -> float:
    """The mean of the last `window` values (0 for none)."""
    tail = values[-window:]
    return sum(tail) / len(tail) if tail else 0.0


PHASES = ("rollout", "train", "publish", "sync", "eval")
HEADER = (f"  {'step':>4s}  {'reward':>6s}  {'eval':>6s}  {'len':>6s}  {'|dlogp|':>8s}  "
          f"{'time_s':>6s}  " + "  ".join(f"{p[:7]:>7s}" for p in PHASES))


def print_row(row: dict[str, Any]) -> None:
    def f(key: str, spec: str) -> str:
        v = row.get(key)
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    print(f"  {row['step']:>4d}  {f('rollout/raw_reward', '.3f'):>6s}  "
          f"{f('eval/mean_reward', '.3f'):>6s}  {f('rollout/response_len/mean', '.2f'):>6s}  "
          f"{f('train/train_rollout_logprob_abs_diff', '.1e'):>8s}  "
          f"{f('perf/loop/step_time', '.1f'):>6s}  "
          + "  ".join(f"{f(f'perf/loop/{p}_time', '.2f'):>7s}" for p in PHASES), flush=True)


def phase_means(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean over the steps of every per-step time (perf/loop/*) and memory (memory/*) figure."""
    keys = sorted({k for r in rows for k in r if k.startswith(("perf/loop/", "memory/"))})
    return {k: sum(v) / len(v) for k in keys
            if (v := [r[k] for r in rows if isinstance(r.get(k), (int, float))])}


def summarize(root: Path, run_dir: Path, *, sft_steps: int, seed: int, started: float,
              task: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    from rltool.rundir import read_metrics

    rows = read_metrics(run_dir / "metrics" / "loop.jsonl")
    rewards = [r["rollout/raw_reward"] for r in rows]
    reached = next((r["step"] for r in rows if r["rollout/raw_reward"] >= TARGET), None)
    sustained = next((rows[i]["step"] for i in range(WINDOW - 1, len(rows))
                      if window_mean(rewards[:i + 1]) >= TARGET), None)
    summary = {"task": task, "seed": seed, "sft_steps": sft_steps, "rl_steps": len(rows),
               "first_rl_reward": rewards[0] if rewards else None,
               "final_rl_reward": rewards[-1] if rewards else None,
               "best_rl_reward": max(rewards, default=None),
               "first_step_reaching_target": reached, "target": TARGET,
               f"first_step_mean{WINDOW}_reaching_target": sustained,
               "final_mean5_reward": window_mean(rewards),
               "evals": {r["step"]: r["eval/mean_reward"] for r in rows if "eval/mean_reward" in r},
               "total_s": time.perf_counter() - started,
               "rewards": [round(x, 4) for x in rewards],
               "phase_means": phase_means(rows), **(extra or {})}
    from rltool import atomic

    atomic.write_json(root / "summary.json", summary)
    return summary


def device_name(device: str) -> str:
    """The GPU's name on cuda, else the CPU core count (for a demo's summary)."""
    import torch

    if device == "cuda":
        return str(torch.cuda.get_device_name())
    return f"{os.cpu_count()} CPU cores"


def fresh(root: Path) -> None:
    from rltool import atomic

    if root.exists():
        if not (root / MARKER).exists():
            raise BadInputError(f"{root} exists and is not a demo directory; pass another DIR")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    atomic.write_text(root / MARKER, "made by `python -m rltool.demo`; safe to delete\n")


def finish(root: Path, clock: Clock) -> None:
    from rltool.loop.report import write_report

    report = write_report(root / "run")
    clock.say(f"rltool report {root / 'run'}: {report['html']}")
    for row in report["summary"]:
        print(f"  {row['metric']:<40s} first {row['first']:>8s}  last {row['last']:>10s}  "
              f"best {row['best']:>8s}")

