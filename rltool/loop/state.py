"""The loop's progress record, `state.json`: which step, the last completed phase of that step and
the policy version, rewritten atomically after every phase.

```
{"step": 3, "phase": "train", "policy_version": 4, "base_version": 3, "num_steps": 10,
 "status": "running",
 "phase_times": {"rollout": 1.2, "train": 0.8}, "publish": {...sync metrics of this step...}}
```
`phase` is null at the start of a step. A phase is recorded only after its artifact's marker exists
(shard `_SUCCESS`, checkpoint `trainer_state.json`, the published `weight_vNNNNNN`, the eval shard),
so resume redoes at most the interrupted phase; phases.py also re-checks the markers, which covers
a kill between an artifact's rename and the state write.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rltool import trace
from rltool.errors import BadInputError
from rltool.faults import kill_point
from rltool.rundir import PHASES, RunDir


@dataclass
class LoopState:
    step: int = 0
    phase: str | None = None
    policy_version: int = 0
    base_version: int = 0  # the version before this step's training (a delta's base)
    num_steps: int = 0
    status: str = "running"
    phase_times: dict[str, float] = field(default_factory=dict)
    publish: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, run: RunDir) -> "LoopState | None":
        data = run.read_state()
        if data is None:
            return None
        try:
            state = cls(**data)
        except TypeError as e:
            raise BadInputError(f"{run.state}: not a loop state ({e}); restore or delete it") from e
        if state.phase is not None and state.phase not in PHASES:
            raise BadInputError(f"{run.state}: unknown phase {state.phase!r}")
        return state

    def save(self, run: RunDir, *, fsync: bool = True) -> None:
        with trace.span("record", cat="phase", step=self.step):
            run.write_state(asdict(self), fsync=fsync)

    def done(self, run: RunDir, phase: str, *, seconds: float | None = None) -> None:
        """Record `phase` of the current step as completed (its marker exists).

        Replaced atomically but not fsynced (the end of a step and the run's status are): a
        crash of the machine may bring back the previous record, which only means redoing
        phases whose artifacts each phase finds by its marker first, as after a kill."""
        self.phase = phase
        if seconds is not None:
            self.phase_times[phase] = seconds
        self.save(run, fsync=False)
        # the resume tests' phase boundaries: RLTOOL_KILL_AT=loop.PHASE:N kills the loop right
        # after the N-th record of PHASE (rltool.faults; docs/reliability.md, "Fault matrix")
        kill_point(f"loop.{phase}")

    def next_step(self, run: RunDir) -> None:
        self.step += 1
        self.phase = None
        self.phase_times = {}
        self.publish = {}
        self.save(run)

    def completed(self, phase: str) -> bool:
        """Whether `phase` of the current step is already recorded (phases run in PHASES order)."""
        return self.phase is not None and PHASES.index(self.phase) >= PHASES.index(phase)
