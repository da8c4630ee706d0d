"""Fault sweep: SIGKILL a stage at every kill point it reaches, re-run it, and check that nothing
partial was visible and the re-run's output is bit-identical to an uninterrupted run.

For each scenario (`rltool train` mid-checkpoint-save, `rltool delta diff/apply/pull`) and each
kill point it passes (RLTOOL_KILL_AT=NAME:N, rltool/faults.py), N counts up from 1 until the
stage completes without reaching the N-th call. After each kill:
  - every artifact a reader may see under its final name is byte-identical to the
    uninterrupted run's (no partial file or directory is visible);
  - the re-run (`--load` the newest checkpoint for train, the same command otherwise) exits 0
    and its output is byte-identical to the uninterrupted run's.
`--schedule-seed S --max-per-point K` samples K values of N in 1..8 per point with a seeded RNG
(a draw past the stage's calls completes unkilled and is skipped; the slow test runs such a
sample, tests/test_faults.py); without them every N is tried.

Example (all points; a few minutes on 2 cores):
  python benchmarks/fault_sweep.py --out benchmarks/results/fault_sweep-DATE-cpu2.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

POINTS = ("publish.file", "publish.dir", "tensor.write", "pull.swap")


def rltool(*args: str, kill: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RLTOOL_KILL_AT", None)
    if kill:
        env["RLTOOL_KILL_AT"] = kill
    return subprocess.run([sys.executable, "-m", "rltool", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def tree_digest(path: Path, *, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every visible (not dot-named) file under `path`, by relative path."""
    out = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts) \
                and p.name not in skip:
            out[rel.as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@dataclass
class Scenario:
    """One stage: `run(work, kill)` runs it once (a re-run when `work` holds a killed run's
    leftovers); `visible(work)` maps each artifact a reader may see to its digest."""
    name: str
    points: tuple[str, ...]
    run: Callable[[Path, str | None], subprocess.CompletedProcess]
    visible: Callable[[Path], dict[str, str]]
    prepare: Callable[[Path], None] = field(default=lambda work: None)
    caps: dict[str, int] = field(default_factory=dict)  # sampled N stays <= cap (default 8)


def make_scenarios(inputs: Path) -> list[Scenario]:
    """Build the inputs once (two tiny models, SFT prompts, a delta chain) and the scenarios."""
    from rltool.data.models import init_model
    from rltool.data.tasks import make_rows, write_prompts

    base = init_model(inputs / "base", arch="qwen2", preset="tiny", task="reverse", seed=0)
    new = init_model(inputs / "new", arch="qwen2", preset="tiny", task="reverse", seed=1)
    write_prompts(make_rows("reverse", num=24, seed=1), inputs / "sft.jsonl")
    source = inputs / "weights"
    shutil.copytree(base, source / "weight_v000000")
    (source / "weight_v000000" / "rltool_version.json").write_text('{"version": 0}\n')
    proc = rltool("delta", "diff", "--base", str(base), "--new", str(new), "--out",
                  str(source / "weight_v000001"), "--base-version", "0", "--version", "1")
    assert proc.returncode == 0, proc.stderr

    def train(work: Path, kill: str | None) -> subprocess.CompletedProcess:
        save = work / "ckpt"
        load = save if any(save.glob("step-*")) else base
        return rltool("train", "--loss", "sft", "--prompts", str(inputs / "sft.jsonl"),
                      "--load", str(load), "--save", str(save), "--num-steps", "3",
                      "--save-interval", "1", "--global-batch-size", "4", "--lr", "1e-3",
                      "--seed", "0", "--deterministic", "--no-shuffle", kill=kill)

    def train_visible(work: Path) -> dict[str, str]:
        # trainer_state.json records wall-clock timings; its presence (the marker) is compared.
        # config.toml records this run's own flags (its --load differs on a re-run).
        return tree_digest(work / "ckpt", skip=("trainer_state.json", "config.toml")) | {
            p.relative_to(work).as_posix(): "present"
            for p in (work / "ckpt").glob("step-*/trainer_state.json")}

    def diff(work: Path, kill: str | None) -> subprocess.CompletedProcess:
        return rltool("delta", "diff", "--base", str(base), "--new", str(new), "--out",
                      str(work / "delta"), "--workers", "2", "--base-version", "0",
                      "--version", "1", kill=kill)

    def apply(work: Path, kill: str | None) -> subprocess.CompletedProcess:
        return rltool("delta", "apply", "--base", str(base), "--delta",
                      str(source / "weight_v000001"), "--out", str(work / "applied"),
                      "--workers", "2", kill=kill)

    def pull_prepare(work: Path) -> None:
        proc = rltool("delta", "pull", "--local", str(work / "local"), "--source", str(source),
                      "--version", "0")
        assert proc.returncode == 0, proc.stderr

    def pull(work: Path, kill: str | None) -> subprocess.CompletedProcess:
        return rltool("delta", "pull", "--local", str(work / "local"), "--source", str(source),
                      "--version", "1", "--workers", "2", kill=kill)

    def pull_visible(work: Path) -> dict[str, str]:
        # An engine reads `local` only after the pull returns; the state file says which
        # version it holds. Compared after the re-run only.
        return tree_digest(work / "local")

    return [
        Scenario("train", ("publish.file", "publish.dir"), train, train_visible,
                 caps={"publish.dir": 3}),
        Scenario("delta diff", ("publish.file", "publish.dir", "tensor.write"), diff,
                 lambda w: tree_digest(w), caps={"publish.file": 2, "publish.dir": 1}),
        Scenario("delta apply", ("publish.file", "publish.dir", "tensor.write"), apply,
                 lambda w: tree_digest(w), caps={"publish.file": 1, "publish.dir": 1}),
        Scenario("delta pull", ("publish.file", "publish.dir", "tensor.write", "pull.swap"), pull,
                 pull_visible, pull_prepare, caps={"publish.file": 3, "publish.dir": 1}),
    ]


def sweep(scenario: Scenario, scratch: Path, *, rng: random.Random | None,
          max_per_point: int | None, max_n: int = 400, sample_cap: int = 8) -> dict:
    ref_work = scratch / f"{scenario.name.replace(' ', '-')}-ref"
    ref_work.mkdir()
    scenario.prepare(ref_work)
    proc = scenario.run(ref_work, None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reference = scenario.visible(ref_work)
    result = {"kills": 0, "failures": [], "points": {}, "killed_at": []}
    for point in scenario.points:
        # How many times the stage reaches this point: count until it completes unkilled.
        reached = 0
        candidates = list(range(1, max_n + 1))
        if rng is not None and max_per_point is not None:
            candidates = sorted(rng.sample(range(1, scenario.caps.get(point, sample_cap) + 1),
                                           max_per_point))
        for n in candidates:
            work = scratch / f"{scenario.name.replace(' ', '-')}-{point}-{n}"
            work.mkdir()
            scenario.prepare(work)
            proc = scenario.run(work, f"{point}:{n}")
            if proc.returncode == 0:
                shutil.rmtree(work)
                if rng is None:
                    break  # the stage reaches this point fewer than n times
                continue
            reached = max(reached, n)
            problem = check_killed(scenario, work, proc, reference)
            if problem is None:
                again = scenario.run(work, None)
                if again.returncode != 0:
                    problem = f"re-run failed: {again.stderr.strip().splitlines()[-1:]}"
                elif scenario.visible(work) != reference:
                    problem = "re-run output differs from the uninterrupted run"
            result["kills"] += 1
            result["killed_at"].append(f"{point}:{n}")
            if problem:
                result["failures"].append(f"{point}:{n}: {problem}")
            shutil.rmtree(work)
        result["points"][point] = reached
    shutil.rmtree(ref_work)
    return result


def check_killed(scenario: Scenario, work: Path, proc: subprocess.CompletedProcess,
                 reference: dict[str, str]) -> str | None:
    if proc.returncode != -9:
        return f"expected SIGKILL, got exit {proc.returncode}: {proc.stderr[-300:]}"
    if scenario.name == "delta pull":
        return None
    seen = scenario.visible(work)
    partial = [k for k, v in seen.items() if reference.get(k) != v]
    return f"partial artifacts visible: {partial[:3]}" if partial else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=None, help="Scenario names, comma-separated.")
    parser.add_argument("--schedule-seed", type=int, default=None)
    parser.add_argument("--max-per-point", type=int, default=None)
    parser.add_argument("--out", default=None, help="Write the JSON result here too.")
    args = parser.parse_args(argv)
    rng = random.Random(args.schedule_seed) if args.schedule_seed is not None else None
    t0 = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="rltool-fault-sweep-") as tmp:
        scratch = Path(tmp)
        (scratch / "inputs").mkdir()
        for scenario in make_scenarios(scratch / "inputs"):
            if args.only and scenario.name not in args.only.split(","):
                continue
            s0 = time.perf_counter()
            results[scenario.name] = sweep(scenario, scratch, rng=rng,
                                           max_per_point=args.max_per_point)
            results[scenario.name]["seconds"] = round(time.perf_counter() - s0, 1)
            r = results[scenario.name]
            print(f"{scenario.name:12s} kills {r['kills']:4d}  failures {len(r['failures']):3d}  "
                  f"points {r['points']}  {r['seconds']:.0f}s", flush=True)
    out = {"benchmark": "fault_sweep", "date": time.strftime("%Y-%m-%d"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
           "schedule_seed": args.schedule_seed, "max_per_point": args.max_per_point,
           "total_kills": sum(r["kills"] for r in results.values()),
           "total_failures": sum(len(r["failures"]) for r in results.values()),
           "seconds": round(time.perf_counter() - t0, 1), "scenarios": results}
    print(json.dumps({k: out[k] for k in ("total_kills", "total_failures", "seconds")}))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    sys.exit(1 if main()["total_failures"] else 0)
