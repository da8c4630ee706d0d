"""Fault sweep: SIGKILL a stage at every kill point it reaches, re-run it, and check that nothing
partial was visible and the re-run's output is bit-identical to an uninterrupted run.

The sweep is rltool.fault_sweep (its docstring says what each scenario runs and checks); this
runs every scenario (or `--only` some) and records the kills and failures. `--schedule-seed S
--max-per-point K` samples K values of N in 1..8 per point with a seeded RNG (the slow test,
tests/test_faults.py, runs such a sample); without them every N is tried. Exit 1 on a failure.

Example (all points; a few minutes on 2 cores):
  python -m benchmarks.fault_sweep --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys

from rltool.fault_sweep import run_sweep

from benchmarks import harness


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=None, help="Scenario names, comma-separated.")
    parser.add_argument("--schedule-seed", type=int, default=None)
    parser.add_argument("--max-per-point", type=int, default=None)
    parser.add_argument("--out", default=None, help="Write the JSON record here too.")
    args = parser.parse_args(argv)
    run = harness.Run("fault_sweep")

    def report(name: str, r: dict) -> None:
        print(f"{name:12s} kills {r['kills']:4d}  failures {len(r['failures']):3d}  "
              f"points {r['points']}  {r['seconds']:.0f}s", flush=True)

    results = run_sweep(only=args.only.split(",") if args.only else None,
                        schedule_seed=args.schedule_seed, max_per_point=args.max_per_point,
                        on_scenario=report)
    return run.finish({"schedule_seed": args.schedule_seed, "max_per_point": args.max_per_point,
                       "total_kills": sum(r["kills"] for r in results.values()),
                       "total_failures": sum(len(r["failures"]) for r in results.values()),
                       "scenarios": results}, out=args.out)


if __name__ == "__main__":
    sys.exit(1 if main()["total_failures"] else 0)
