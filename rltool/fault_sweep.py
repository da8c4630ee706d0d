"""The fault matrix: SIGKILL a stage at every kill point it reaches (rltool/faults.py), re-run it,
and check that nothing partial was visible and the re-run's output is bit-identical to an
uninterrupted run's.

For each scenario (`rltool train` mid-checkpoint-save, `rltool delta diff/apply/pull`) and each
kill point it passes (RLTOOL_KILL_AT=NAME:N), N counts up from 1 until the stage completes
without reaching the N-th call. After each kill:
  - every artifact a reader may see under its final name is byte-identical to the
    uninterrupted run's (no partial file or directory is visible);
  - the re-run (`--load` the newest checkpoint for train, the same command otherwise) exits 0
    and its output is byte-identical to the uninterrupted run's.
With a schedule seed, K values of N in 1..8 per point are drawn instead (a draw past the stage's
calls completes unkilled and is skipped). Every stage runs as `python -m rltool` in a child
process, so this module imports no stage. `benchmarks/fault_sweep.py` runs the whole sweep;
tests/test_faults.py a seeded sample of it.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rltool.errors import RltoolError
from rltool.faults import ENV

POINTS = ("publish.file", "publish.dir", "tensor.write", "pull.swap")


def rltool(*args: str, kill: str | None = None) -> subprocess.CompletedProcess:
    """`python -m rltool ARGS` in a fresh process, killed at `kill` (NAME:N) when given."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(ENV, None)
    if kill:
        env[ENV] = kill
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


def checked(proc: subprocess.CompletedProcess) -> None:
    """Raise when an unkilled run (an input's build, a reference run) failed."""
    if proc.returncode != 0:
        raise RltoolError(f"{' '.join(map(str, proc.args[2:]))} failed "
                          f"({proc.returncode}): {proc.stderr[-2000:]}")


def make_scenarios(inputs: Path) -> list[Scenario]:
    """Build the inputs once through the command line (two tiny models, SFT prompts, a delta
    chain) and the scenarios."""
    base, new = inputs / "base", inputs / "new"
    for out, seed in ((base, 0), (new, 1)):
        checked(rltool("init-model", "--arch", "qwen2", "--preset", "tiny", "--task", "reverse",
                       "--seed", str(seed), "--out", str(out), "-q"))
    checked(rltool("data", "make", "--task", "reverse", "--num", "24", "--seed", "1", "--out",
                   str(inputs / "sft.jsonl"), "-q"))
    source = inputs / "weights"
    shutil.copytree(base, source / "weight_v000000")
    (source / "weight_v000000" / "rltool_version.json").write_text('{"version": 0}\n')
    checked(rltool("delta", "diff", "--base", str(base), "--new", str(new), "--out",
                   str(source / "weight_v000001"), "--base-version", "0", "--version", "1"))

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
        checked(rltool("delta", "pull", "--local", str(work / "local"), "--source", str(source),
                       "--version", "0"))

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
    """Kill the scenario at each of its points, N = 1, 2, ... until it completes unkilled (with
    `rng` and `max_per_point`: that many seeded draws of N per point instead); after each kill,
    check what is visible and re-run. Returns the kills, the failures (NAME:N: what went wrong)
    and the largest N reached per point."""
    ref_work = scratch / f"{scenario.name.replace(' ', '-')}-ref"
    ref_work.mkdir()
    scenario.prepare(ref_work)
    checked(scenario.run(ref_work, None))
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


def run_sweep(*, only: list[str] | None = None, schedule_seed: int | None = None,
              max_per_point: int | None = None,
              on_scenario: Callable[[str, dict], None] | None = None) -> dict:
    """Sweep every scenario (or those named in `only`) in a scratch directory: {name: its
    sweep result with "seconds"}; `on_scenario(name, result)` is called as each finishes."""
    rng = random.Random(schedule_seed) if schedule_seed is not None else None
    results = {}
    with tempfile.TemporaryDirectory(prefix="rltool-fault-sweep-") as tmp:
        scratch = Path(tmp)
        (scratch / "inputs").mkdir()
        for scenario in make_scenarios(scratch / "inputs"):
            if only and scenario.name not in only:
                continue
            start = time.perf_counter()
            result = sweep(scenario, scratch, rng=rng, max_per_point=max_per_point)
            result["seconds"] = round(time.perf_counter() - start, 1)
            results[scenario.name] = result
            if on_scenario is not None:
                on_scenario(scenario.name, result)
    return results
