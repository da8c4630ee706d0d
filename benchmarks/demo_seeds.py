"""The demo learns for every seed: `python -m rltool.demo --seed S` for S in 0..N-1, each in a
fresh process, until the 5-step mean reward reaches its target (or the step cap).

Prints a table and one JSON line; `--out FILE` also writes the JSON (machine, load average,
every seed's steps, wall clock and reward curve). Exit 1 when a seed misses the target.

Example:
  python -m benchmarks.demo_seeds --seeds 5 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks import harness
from benchmarks.demo import one_run  # one `python -m rltool.demo` in a fresh process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="Seeds 0..N-1.")
    parser.add_argument("--out", default=None, help="Write the JSON result here too.")
    args = parser.parse_args()
    run = harness.Run("demo_seeds")
    key = "first_step_mean5_reaching_target"
    runs = []
    print(f"{'seed':>4s} {'first':>6s} {'reached@':>8s} {'steps':>5s} {'last5':>6s} "
          f"{'wall_s':>7s}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rltool-demo-seeds-") as tmp:
        for seed in range(args.seeds):
            r = one_run(Path(tmp) / f"seed{seed}", ["--seed", str(seed)])
            runs.append(r)
            print(f"{seed:>4d} {r['first_rl_reward']:6.3f} {str(r[key]):>8s} {r['rl_steps']:>5d} "
                  f"{r['final_mean5_reward']:6.3f} {r['wall_s']:7.1f}", flush=True)
    reached = sum(r[key] is not None for r in runs)
    run.finish({"seeds": args.seeds, "reached": reached}, out=args.out, detail={"runs": runs})
    sys.exit(0 if reached == args.seeds else 1)


if __name__ == "__main__":
    main()
