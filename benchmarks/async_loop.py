"""`rltool loop --mode async` against the synchronous loop on the demo's workload, pinned.

Per seed: the demo's model init and supervised warm start (rltool.demo), then
- sync: the demo's loop (resident trainer in the loop process, tensor sync), the engine pinned to
  `--engine-cores`, the loop process (trainer, rollout client) to `--trainer-cores`;
- async: the same tables with `--mode async --placement disaggregated --max-staleness K
  --update-mode MODE` and `[train] tis_mode` (ICEPOP by default), the same pinning (the
  rollout worker beside the engine), more steps (to see when it reaches the sync run's reward).
Both run past the speed window: the sync run `--learning-steps` steps (the demo's run length),
the async run `--async-steps-factor` times that.
Neither run evaluates (eval would add its own engine and time). The async run's samples carry the
sync run's uids, so both draw from the same sampling seeds (the same prompts in the same order).
With `--on-policy-control` a third run per seed is async with `--max-staleness 0` (nothing starts
while the trainer trains): it checks that the async path itself learns as the sync loop does, so
that what is left of the difference is the staleness.

Figures, from each run's metrics/loop.jsonl:
- t_R, t_T, t_W: the sync run's median rollout, train + publish and sync phase times per step
  (`rltool profile`'s split: the trainer publishes, the engines stop only to load);
- bound = (t_R + t_T + t_W) / (max(t_R, t_T) + t_W) (rltool.profile.analyze.async_speedup);
- speedup = sync seconds per step / async seconds per step, both from the rows' wall-clock
  `time` between the first and the last of the first `--steps` steps (engine start excluded);
- learning: target = the reward the demo finishes at (`--target-reward`, the demo's 0.8: `make
  demo` stops once its 5-step mean reaches it); the samples each run used until its 5-step mean
  first reached the target, and their ratio async / sync (an async run that never reaches it
  counts as infinitely many samples in the median; a seed whose sync run does not is left out).

Prints a table and one JSON line; `--out DIR` also writes the JSON (machine, load averages,
every run's rows) as DIR/async_loop-DATE-DEVICE.json. Example (2 cores, engine on core 0,
trainer on core 1):
  python -m benchmarks.async_loop --seeds 0 1 2 --steps 20 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rltool.demo_common import TARGET, WINDOW

from benchmarks import harness


def prepare(root: Path, seed: int) -> Path:
    """The demo's prompts, model init and warm start for `seed`; the warm-started weights."""
    from rltool.data.models import init_model
    from rltool.demo import TASK, Clock, make_data, warm_start

    root.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    make_data(root, clock)
    model = init_model(root / "model", arch="qwen2", preset="tiny", task=TASK, seed=seed)
    weights, _ = warm_start(root, model, sft_steps=60, seed=seed, clock=clock)
    return weights


def run_loop(root: Path, name: str, tables: dict[str, Any]) -> list[dict[str, Any]]:
    import tomli_w

    from rltool.rundir import read_metrics

    config = root / f"{name}.toml"
    config.write_text(tomli_w.dumps(tables))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rltool", "loop", "-q", "--config", str(config),
                    "--run-dir", str(root / name)], check=True, env=env)
    print(f"  {name}: {time.perf_counter() - t0:.1f}s", flush=True)
    return read_metrics(root / name / "metrics" / "loop.jsonl")


def first_reaching(rows: list[dict[str, Any]], target: float) -> int | None:
    rewards = [r["rollout/raw_reward"] for r in rows]
    for i in range(len(rewards)):
        tail = rewards[max(0, i + 1 - WINDOW):i + 1]
        if i + 1 >= WINDOW and sum(tail) / len(tail) >= target:
            return i + 1  # steps used
    return None


def seconds_per_step(rows: list[dict[str, Any]], steps: int) -> float:
    rows = rows[:steps]
    return (rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1)


def one_seed(root: Path, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    from rltool.demo import loop_tables
    from rltool.profile.analyze import async_speedup

    load = harness.load_average()
    weights = prepare(root, seed)
    base = loop_tables(root, model=weights, steps=max(args.steps, args.learning_steps),
                       seed=seed)
    base.pop("eval")
    base["sync"]["sync"] = "tensor"
    # A served engine in both runs: the demo's in-process engine (a thread of the loop process)
    # cannot be pinned apart from the trainer, and async needs engines of their own.
    base["loop"].update(eval_interval=None, engine="serve", engine_cores=args.engine_cores,
                        trainer_cores=args.trainer_cores,
                        engine_args=["--max-running-requests", "128", "--num-threads", "1"])
    base["loop"] = {k: v for k, v in base["loop"].items() if v is not None}
    sync_rows = run_loop(root, "sync", base)
    tables = json.loads(json.dumps(base))
    tables["loop"].update(mode="async", placement="disaggregated",
                          max_staleness=args.max_staleness, update_mode=args.update_mode,
                          num_steps=int(base["loop"]["num_steps"] * args.async_steps_factor))
    tables["train"]["tis_mode"] = args.tis_mode  # decoupled PPO on the stale tokens
    async_rows = run_loop(root, "async", tables)
    t_r = statistics.median(r["perf/loop/rollout_time"] for r in sync_rows)
    t_t = statistics.median(r["perf/loop/train_time"] + r["perf/loop/publish_time"]
                            for r in sync_rows)
    t_w = statistics.median(r["perf/loop/sync_time"] for r in sync_rows)
    bound = async_speedup(t_R_s=t_r, t_T_s=t_t, t_W_s=t_w)["speedup_bound"]
    sync_s, async_s = (seconds_per_step(sync_rows, args.steps),
                       seconds_per_step(async_rows, args.steps))
    target = args.target_reward
    sync_reach, async_reach = first_reaching(sync_rows, target), first_reaching(async_rows, target)
    samples = sync_rows[0]["rollout/num_samples"]
    control: dict[str, Any] = {}
    if args.on_policy_control:
        on_policy = json.loads(json.dumps(tables))
        on_policy["loop"]["max_staleness"] = 0
        control_rows = run_loop(root, "async-on-policy", on_policy)
        reach = first_reaching(control_rows, target)
        control = {"control_rows": control_rows,
                   "control_samples_to_target": reach * samples if reach else None,
                   "control_reward_max_diff": max(
                       abs(a["rollout/raw_reward"] - b["rollout/raw_reward"])
                       for a, b in zip(sync_rows, control_rows))}
    return {"seed": seed, "load_avg": load, "t_R": t_r, "t_T": t_t, "t_W": t_w, "bound": bound,
            "sync_s_per_step": sync_s, "async_s_per_step": async_s, "speedup": sync_s / async_s,
            "of_bound": (sync_s / async_s) / bound, "target_reward": target,
            "sync_samples_to_target": sync_reach * samples if sync_reach else None,
            "async_samples_to_target": async_reach * samples if async_reach else None,
            "samples_ratio": (async_reach / sync_reach) if sync_reach and async_reach else None,
            "async_reached": async_reach is not None, "sync_reached": sync_reach is not None,
            "staleness_mean": statistics.mean(r.get("staleness/mean", 0.0) for r in async_rows),
            "staleness_dropped": sum(r.get("staleness/dropped", 0) for r in async_rows),
            "sync_rows": sync_rows, "async_rows": async_rows, **control}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=20, help="Sync steps (the speed window).")
    parser.add_argument("--learning-steps", type=int, default=60,
                        help="Sync steps in all (the demo reaches its target in ~30).")
    parser.add_argument("--async-steps-factor", type=float, default=1.5,
                        help="Async runs this many times the sync run's steps.")
    parser.add_argument("--target-reward", type=float, default=TARGET,
                        help="The 5-step mean reward both runs race to (the demo's target).")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--update-mode", default="in-place",
                        choices=["in-place", "retract", "abort"])
    parser.add_argument("--tis-mode", default="icepop",
                        choices=["none", "truncate", "clip", "icepop"],
                        help="Off-policy correction of the async run (docs/loop.md: ICEPOP for "
                        "the demo's large learning rate; truncate learned less stably).")
    parser.add_argument("--engine-cores", type=int, nargs="+", default=[0])
    parser.add_argument("--trainer-cores", type=int, nargs="+", default=[1])
    parser.add_argument("--on-policy-control", action="store_true",
                        help="Also run async with --max-staleness 0 per seed (see above).")
    parser.add_argument("--out", default=None, help="Write the JSON result here too.")
    args = parser.parse_args()
    run = harness.Run("async_loop")
    runs = []
    with tempfile.TemporaryDirectory(prefix="rltool-async-bench-") as tmp:
        for seed in args.seeds:
            runs.append(one_seed(Path(tmp) / f"seed{seed}", seed, args))
    header = (f"{'seed':>4s} {'t_R':>6s} {'t_T':>6s} {'t_W':>6s} {'bound':>6s} {'sync s':>7s} "
              f"{'async s':>7s} {'speedup':>7s} {'%bound':>6s} {'samples x':>9s}")
    print(header)
    for r in runs:
        ratio = f"{r['samples_ratio']:.2f}" if r["samples_ratio"] is not None else "-"
        print(f"{r['seed']:>4d} {r['t_R']:6.3f} {r['t_T']:6.3f} {r['t_W']:6.3f} "
              f"{r['bound']:6.2f} {r['sync_s_per_step']:7.3f} {r['async_s_per_step']:7.3f} "
              f"{r['speedup']:7.2f} {100 * r['of_bound']:5.0f}% {ratio:>9s}")
    ratios = [r["samples_ratio"] if r["async_reached"] else math.inf
              for r in runs if r["sync_reached"]]
    median_ratio = statistics.median(ratios) if ratios else math.inf
    summary = {"settings": vars(args),
               "median_speedup": statistics.median(r["speedup"] for r in runs),
               "median_bound": statistics.median(r["bound"] for r in runs),
               "median_of_bound": statistics.median(r["of_bound"] for r in runs),
               "median_samples_ratio": median_ratio if math.isfinite(median_ratio) else None,
               "seeds_sync_reaching_target": len(ratios),
               "seeds_async_reaching_target": sum(math.isfinite(x) for x in ratios)}
    run.finish(summary, out=args.out, detail={"runs": runs})


if __name__ == "__main__":
    main()
