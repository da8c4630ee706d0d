"""The `make demo` target, measured: R full demo runs (SFT warm start + RL until the 5-step mean
reward reaches 0.8) beside a same-run baseline without the warm start (pure RL from random init).

Each run is `python -m rltool.demo DIR --json` in a fresh process (imports included, installs
excluded). Prints a table and one JSON line; `--out FILE` also writes the JSON (the machine, its
load average and every run's reward curve); a directory gets demo-DATE-DEVICE.json.

Example:
  python -m benchmarks.demo --runs 2 --out benchmarks/results

`--compare-with CHECKOUT --seeds 0 1 2` instead measures the loop step of this checkout against
another one (e.g. the previous release) on the same machine: for each seed it runs the other
checkout's demo, then this one's, alternately (so a change in the machine's load hits both),
and reports per run the median loop step, the median time of each phase (wall, and CPU seconds of
the loop process where the build records them: less moved by other load on a shared machine) and
the first step whose 5-step mean reward reaches 0.8, with the load average around every run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

TARGET_S = 600.0


def one_run(root: Path, args: list[str]) -> dict[str, Any]:
    """`python -m rltool.demo` of this checkout (not whichever rltool the interpreter would
    import from elsewhere: an installed or editable copy of another checkout)."""
    here = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rltool.demo", str(root), "--json", *args],
                          capture_output=True, text=True, env=env, cwd=here, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"demo failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((root / "summary.json").read_text())
    summary["wall_s"] = wall
    summary["load_avg_after"] = harness.load_average()
    return summary


PHASES = ("rollout", "train", "publish", "sync", "eval")


def seeded_run(root: Path, *, checkout: Path, seed: int, steps: int) -> dict[str, Any]:
    """One demo run of `checkout`'s rltool with the demo's seed set to `seed`."""
    import statistics

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(checkout))
    code = (f"import rltool, rltool.demo as d; d.SEED = {seed}; "
            f"open({str(root) + '.rltool'!r}, 'w').write(rltool.__file__); "
            f"d.main([{str(root)!r}, '--json', '--steps', '{steps}'])")
    load_before = harness.load_average()
    t0 = time.perf_counter()
    # cwd: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH.
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=checkout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"demo of {checkout} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    imported = Path(Path(str(root) + ".rltool").read_text())
    if checkout not in imported.parents:
        raise RuntimeError(f"the run imported {imported}, not {checkout}'s rltool")
    summary = json.loads((root / "summary.json").read_text())
    rows = [json.loads(line) for line in
            (root / "run" / "metrics" / "loop.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [r for r in rows if "perf/loop/eval_time" not in r]  # eval steps apart

    def median(key: str) -> float | None:
        values = [r[key] for r in steps_rows if key in r]
        return statistics.median(values) if values else None

    def step_cpu(r: dict[str, Any]) -> float | None:
        parts = [r[f"perf/loop/{p}_cpu_time"] for p in PHASES if f"perf/loop/{p}_cpu_time" in r]
        return sum(parts) if parts else None

    cpu_steps = [c for c in map(step_cpu, steps_rows) if c is not None]
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    return {"checkout": f"rltool {commit or 'unknown commit'}", "seed": seed, "wall_s": time.perf_counter() - t0,
            "load_avg_before": load_before, "load_avg_after": harness.load_average(),
            "rl_steps": len(rows), "median_step_s": median("perf/loop/step_time"),
            "median_phase_s": {p: median(f"perf/loop/{p}_time") for p in PHASES},
            # CPU seconds of the loop process (builds that record perf/loop/*_cpu_time)
            "median_step_cpu_s": statistics.median(cpu_steps) if cpu_steps else None,
            "median_phase_cpu_s": {p: median(f"perf/loop/{p}_cpu_time") for p in PHASES},
            "steps_to_target": summary["first_step_mean5_reaching_target"],
            "sync_modes": sorted({str(r.get("sync/mode")) for r in rows}),
            "rewards": summary["rewards"]}


def compare(args: argparse.Namespace) -> None:
    import statistics

    here = Path(__file__).resolve().parents[1]
    other = Path(args.compare_with).resolve()
    run = harness.Run("demo-compare")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rltool-demo-compare-") as tmp:
        for seed in args.seeds:
            for name, checkout in (("before", other), ("after", here)):
                r = seeded_run(Path(tmp) / f"{name}-{seed}", checkout=checkout, seed=seed,
                               steps=args.max_steps)
                r["name"] = name
                runs.append(r)
                phases = " ".join(f"{p}={v:.3f}" for p, v in r["median_phase_s"].items()
                                  if v is not None)
                cpu = (f", CPU {r['median_step_cpu_s']:.3f}s" if r["median_step_cpu_s"] is not None
                       else "")
                print(f"{name:>6s} seed {seed}: median step {r['median_step_s']:.3f}s{cpu} ({phases}); "
                      f"5-step mean reward >= 0.8 at step {r['steps_to_target']}; load "
                      f"{r['load_avg_before'][0]:.1f} -> {r['load_avg_after'][0]:.1f}",
                      flush=True)

    def summary(name: str) -> dict[str, Any]:
        mine = [r for r in runs if r["name"] == name]
        reached = [r["steps_to_target"] for r in mine if r["steps_to_target"] is not None]
        cpus = [r["median_step_cpu_s"] for r in mine if r["median_step_cpu_s"] is not None]
        return {"median_step_s": statistics.median(r["median_step_s"] for r in mine),
                "median_step_cpu_s": statistics.median(cpus) if cpus else None,
                "median_steps_to_target": statistics.median(reached) if reached else None,
                "runs_reaching_target": len(reached), "runs": len(mine)}

    run.finish({"before": summary("before"), "after": summary("after"), "runs": runs},
               out=args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="Full demo runs.")
    parser.add_argument("--baseline-steps", type=int, default=30,
                        help="RL steps of the no-warm-start baseline.")
    parser.add_argument("--out", default=None, help="Write the JSON result here too.")
    parser.add_argument("--compare-with", default=None, metavar="CHECKOUT",
                        help="Another rltool checkout to measure against, alternating runs.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="Demo seeds of --compare-with runs.")
    parser.add_argument("--max-steps", type=int, default=150,
                        help="Most RL steps per --compare-with run.")
    args = parser.parse_args()
    if args.compare_with:
        compare(args)
        return
    run = harness.Run("demo")
    with tempfile.TemporaryDirectory(prefix="rltool-demo-bench-") as tmp:
        runs = [one_run(Path(tmp) / f"demo{i}", []) for i in range(args.runs)]
        baseline = one_run(Path(tmp) / "pure-rl", ["--sft-steps", "0", "--steps",
                                                   str(args.baseline_steps)])
    key = "first_step_mean5_reaching_target"
    print(f"{'run':>8s} {'sft':>4s} {'steps':>5s} {'first':>6s} {'last5':>6s} {'best':>6s} "
          f"{'reached@':>8s} {'wall_s':>7s} {'target':>6s}")
    for name, r in [(f"demo{i}", r) for i, r in enumerate(runs)] + [("pure-rl", baseline)]:
        ok = (r["first_rl_reward"] <= 0.3 and r[key] is not None and r["wall_s"] < TARGET_S)
        print(f"{name:>8s} {r['sft_steps']:>4d} {r['rl_steps']:>5d} {r['first_rl_reward']:6.3f} "
              f"{r['final_mean5_reward']:6.3f} {r['best_rl_reward']:6.3f} "
              f"{str(r[key]):>8s} {r['wall_s']:7.1f} {'met' if ok else 'missed':>6s}")
    run.finish({"target": {"first_rl_reward_max": 0.3, "reward": 0.8, "wall_s": TARGET_S},
              "runs": runs, "baseline_pure_rl": baseline,
              "met": [r["first_rl_reward"] <= 0.3 and r[key] is not None
                      and r["wall_s"] < TARGET_S for r in runs]}, out=args.out)


if __name__ == "__main__":
    main()
