"""`rltool loop --launcher ray`: the engines and the trainer run in Ray actors, placed with one
placement group.

Placement: one bundle per engine ({CPU: 1, GPU: ray_engine_gpus}); colocated, the trainer
actor shares engine 0's bundle (its GPUs half each, plus a CPU per trainer rank), disaggregated
it gets a bundle of its own ({CPU: ray_trainer_ranks, GPU: ray_trainer_gpus}). Strategy PACK:
Ray packs the bundles on as few nodes as fit and spreads them when one node is not enough.

The actors run the same stage code as the local launcher: an `EngineActor` starts `rltool serve`
(rltool.rollout.launch.start_engine, dying with the actor) and reports its URL; the trainer actor
runs `rltool.train.run` on each step's config. A dead engine actor is restarted by Ray
(`ray_max_restarts`); while the rollout that lost it goes on, its requests are re-dispatched to
the other engines by the rollout's router, and before the next engine call the loop notices the
new URL and loads the version the others serve into it (so only disk sync modes: full, delta,
auto). On a Ray cluster (`ray_address`) each engine serves on its node's address with the
loop's admin key. On exit the actors are killed, the placement group removed and a Ray instance
the loop started shut down.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rltool.errors import BadInputError, EngineError
from rltool.loop import lora_sync
from rltool.loop.config import LoopSettings
from rltool.loop.engines import ChildRegistry, EngineSet
from rltool.rundir import RunDir

log = logging.getLogger(__name__)
ACTOR_PREFIX = "rltool-engine"


class EngineActor:
    """One builtin engine in a Ray actor: `rltool serve` as the actor's child."""

    def __init__(self, args: list[str], log_path: str, ready_timeout_s: float,
                 keys: dict[str, str | None], on_cluster: bool):
        """`keys`: the engine's api_key and admin_api_key, given by environment, not argv. On a
        Ray cluster the engine serves on this node's address, which it refuses without an
        admin key."""
        from rltool.loop.keys import engine_env
        from rltool.rollout.launch import start_engine

        if on_cluster:
            import ray

            args = [*args, "--host", ray.util.get_node_ip_address()]
        self.proc = start_engine(args, log_path=Path(log_path), ready_timeout_s=ready_timeout_s,
                                 env=engine_env(**keys), die_with_parent=True)

    def url(self) -> str:
        return str(self.proc.url)

    def engine_pid(self) -> int:
        return int(self.proc.pid)

    def stop(self) -> None:
        self.proc.stop()


class TrainerActor:
    """The train stage in a Ray actor: `rltool.train.run` on the config the loop gives it, or
    with several ranks the same under torchrun (rltool.train.launch, as `rltool train
    --nproc-per-node N` does)."""

    def train(self, values: dict[str, Any], ranks: int) -> None:
        from rltool.train import run
        from rltool.train.config import TrainConfig
        from rltool.train.launch import launch

        cfg = TrainConfig(**values)
        if ranks == 1:
            run(cfg)
        elif launch(cfg, nproc_per_node=ranks, extra_args=["--quiet"]) != 0:
            raise EngineError(f"a trainer rank failed on {cfg.rollouts}; see the actor's log")


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": float(cpus), **({"GPU": gpus} if gpus else {})}


def ray_module() -> Any:
    try:
        import ray
    except ImportError as e:
        raise BadInputError("--launcher ray needs Ray: pip install 'rltool[ray]'") from e
    return ray


class RayPlacement(EngineSet):
    """The loop's engines (and trainer) as Ray actors (see the module docstring)."""

    def __init__(self, run: RunDir, registry: ChildRegistry, settings: LoopSettings):
        loop = settings.loop
        super().__init__(run, registry, num_engines=loop.num_engines,
                         engine_args=lora_sync.engine_args(settings, loop.engine_args),
                         deterministic=loop.deterministic,
                         ready_timeout_s=loop.engine_ready_timeout_s)
        self.loop = loop
        self.serve_keys = {"api_key": loop.api_key, "admin_api_key": loop.admin_api_key}
        self.api_key = loop.admin_api_key or loop.api_key
        self.colocated = loop.placement == "colocated"
        self.actors: list[Any] = []
        self.known: list[str] = []  # each engine's URL when it was last brought up to date
        self._targets: list[str] | None = None  # restarted engines being brought up to date
        self.served: tuple[int, bool] = (0, False)  # (version, delta) the engines serve
        self.trainer: Any = None
        self.group: Any = None
        self.started_ray = False

    # ----- placement -------------------------------------------------------------------

    def _bundles(self) -> list[dict[str, float]]:
        """One per engine; colocated, the trainer's ranks join engine 0's, disaggregated they
        get their own (last)."""
        loop = self.loop
        bundles = [_bundle(1.0, loop.ray_engine_gpus) for _ in range(self.num_engines)]
        if self.colocated:
            bundles[0]["CPU"] += loop.ray_trainer_ranks
        else:
            bundles.append(_bundle(loop.ray_trainer_ranks, loop.ray_trainer_gpus))
        return bundles

    def _options(self, bundle: int, *, cpus: float, gpus: float) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": cpus, "num_gpus": gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=bundle)}

    def start(self, model_dir: Path) -> None:
        ray = ray_module()
        from ray.util.placement_group import placement_group

        loop = self.loop
        if loop.ray_address is not None and not loop.admin_api_key:
            raise BadInputError("--launcher ray on a cluster serves the engines on their nodes' "
                                "addresses, which needs an admin key: set RLTOOL_ADMIN_API_KEY "
                                "(or [loop] admin_api_key)")
        if not ray.is_initialized():
            if loop.ray_address is not None:
                ray.init(address=loop.ray_address, log_to_driver=False)
            else:
                cpus = loop.ray_num_cpus or int(sum(b["CPU"] for b in self._bundles()))
                ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
                self.started_ray = True
        self.group = placement_group(self._bundles(), strategy="PACK")
        if not self.group.wait(timeout_seconds=self.ready_timeout_s):
            raise EngineError(f"Ray could not reserve the bundles {self._bundles()} within "
                              f"{self.ready_timeout_s:.0f}s; add nodes or lower "
                              "num_engines/ray_*_gpus")
        if loop.engine_local_dir:
            self.local_weights = Path(loop.engine_local_dir)
        args = ["--engine", "builtin", "--model", str(model_dir), "--local-checkpoint-dir",
                str(self.local_weights), *self.engine_args]
        if self.deterministic and "--deterministic" not in args:
            args.append("--deterministic")
        # Colocated, engine 0 and the trainer share the bundle's GPUs (half each).
        share = 0.5 if self.colocated else 1.0
        actor = ray.remote(EngineActor)
        self.actors = [actor.options(
            name=f"{ACTOR_PREFIX}-{i}-{self.run.root.name}", max_restarts=loop.ray_max_restarts,
            max_task_retries=-1,
            **self._options(i, cpus=1.0, gpus=loop.ray_engine_gpus * (share if i == 0 else 1)))
            .remote(args, str(self.run.log_file(f"engine-{i}")), self.ready_timeout_s,
                    self.serve_keys, loop.ray_address is not None)
            for i in range(self.num_engines)]
        self.known = self._actor_urls()
        bundle, gpus = ((0, loop.ray_engine_gpus * share) if self.colocated
                        else (self.num_engines, loop.ray_trainer_gpus))
        self.trainer = ray.remote(TrainerActor).options(
            **self._options(bundle, cpus=float(loop.ray_trainer_ranks), gpus=gpus)).remote()

    def _actor_urls(self) -> list[str]:
        ray = ray_module()
        try:
            return list(ray.get([a.url.remote() for a in self.actors],
                                timeout=self.ready_timeout_s))
        except ray.exceptions.RayError as e:
            raise EngineError(f"a Ray engine actor failed ({type(e).__name__}: {e}); see "
                              f"{self.run.logs}/engine-*.log") from e

    # ----- engines ---------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """The engines' URLs, after bringing one that Ray restarted up to date."""
        if self._targets is not None:
            return list(self._targets)
        self.check_alive()
        return list(self.known)

    def check_alive(self) -> None:
        """Load the version the others serve into an engine Ray restarted (it has a new URL)."""
        if self._targets is not None:
            return
        current = self._actor_urls()
        restarted = [new for old, new in zip(self.known, current) if old != new]
        self.known = current
        if not restarted:
            return
        version, delta = self.served
        log.warning("engine actor(s) at %s were restarted by Ray; loading version %d into them",
                    restarted, version)
        self._targets = restarted
        try:
            super().load_version(version, delta=delta)
        finally:
            self._targets = None

    def load_version(self, version: int, *, delta: bool) -> float:
        seconds = super().load_version(version, delta=delta)
        self.served = (version, delta)
        return seconds

    def run_trainer(self, cfg: Any) -> None:
        """One step of the train stage in the trainer actor."""
        ray = ray_module()
        try:
            ray.get(self.trainer.train.remote(cfg.model_dump(mode="json", exclude_none=True),
                                              self.loop.ray_trainer_ranks))
        except ray.exceptions.RayError as e:
            raise EngineError(f"the trainer actor failed at {cfg.rollouts}: {e}") from e

    def stop(self) -> None:
        """Kill the actors (their engines die with them), remove the placement group, and shut
        down the Ray instance this loop started; also after a start that failed half-way."""
        if not (self.actors or self.trainer or self.group or self.started_ray):
            return
        ray = ray_module()
        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except ray.exceptions.RayError as e:
                log.warning("stopping an engine actor: %s", e)
            ray.kill(actor, no_restart=True)
        if self.trainer is not None:
            ray.kill(self.trainer, no_restart=True)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        self.actors, self.trainer, self.group, self.known = [], None, None, []
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
