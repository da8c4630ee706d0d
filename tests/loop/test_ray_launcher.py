"""`rltool loop --launcher ray` on one local Ray instance (CPU): engines and the trainer in
actors placed by a placement group; an engine actor killed in the middle of a rollout is restarted
by Ray, its requests go to the other engine, the restarted engine is brought to the served
version, and everything Ray holds is released at the end."""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest

from rltool.loop import runner
from rltool.loop.config import LoopSettings
from rltool.loop.engines import ChildRegistry
from rltool.loop.ray_launcher import ACTOR_PREFIX, RayPlacement
from rltool.rundir import RunDir, read_metrics
from tests.loop.test_external import tables



def kill_a_generating_engine(ray, names: list[str], out: dict, deadline_s: float = 300.0):
    """Wait for the engine actors to serve, poll their engines until one has requests, then
    kill that actor (Ray restarts it); gives up when `out` gets "stop"."""
    deadline = time.monotonic() + deadline_s
    urls: dict[str, str] = {}
    with httpx.Client(timeout=5) as http:
        while time.monotonic() < deadline and not {"engine_pid", "stop"} & set(out):
            for name in names:
                try:
                    if name not in urls:
                        urls[name] = ray.get(ray.get_actor(name).url.remote(), timeout=5)
                    stats = http.get(urls[name] + "/get_server_info").json()["internal_states"][0]
                except (ValueError, ray.exceptions.RayError, httpx.HTTPError):
                    continue  # not created or not serving yet
                if stats["num_running_reqs"] + stats["num_waiting_reqs"]:
                    actor = ray.get_actor(name)
                    out["engine_pid"] = ray.get(actor.engine_pid.remote())
                    ray.kill(actor, no_restart=False)
                    break
            time.sleep(0.005)


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.parametrize(("placement", "bundles"), [
    ("colocated", [{"CPU": 3.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]),
    ("disaggregated", [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0},
                       {"CPU": 2.0, "GPU": 2.0}]),
])
def test_bundles_are_shared_when_colocated_and_separate_otherwise(tiny_model_dir, tmp_path,
                                                                  placement, bundles):
    settings = LoopSettings.from_tables(tables(
        tiny_model_dir, tmp_path, launcher="ray", placement=placement, num_engines=2,
        ray_engine_gpus=1.0, ray_trainer_gpus=2.0, ray_trainer_ranks=2))
    run = RunDir(tmp_path / "run")
    assert RayPlacement(run, ChildRegistry(run), settings)._bundles() == bundles


@pytest.mark.slow
def test_killed_engine_actor_is_restarted_and_the_run_completes(local_ray, tiny_model_dir,
                                                                tmp_path):
    ray = local_ray
    run = tmp_path / "run"
    data = tables(tiny_model_dir, tmp_path, launcher="ray", num_engines=2,
                  engine_args=["--num-threads", "1"])
    # One group at a time per engine, long enough to be seen generating.
    data["rollout"].update(rollout_batch_size=8, concurrency=1, max_response_len=16)
    names = [f"{ACTOR_PREFIX}-{i}-{run.name}" for i in range(2)]
    killed: dict = {}
    killer = threading.Thread(target=kill_a_generating_engine, args=(ray, names, killed),
                              daemon=True)
    killer.start()
    served: list[set[str]] = []

    def on_step(row):
        urls = ray.get([ray.get_actor(name).url.remote() for name in names])
        served.append({httpx.get(u + "/get_weight_version", timeout=30).json()["weight_version"]
                       for u in urls})

    try:
        result = runner.start(LoopSettings.from_tables(data), run, on_step=on_step)
    finally:
        killed["stop"] = True
        killer.join(timeout=30)
    rows = read_metrics(RunDir(run).metrics_file("loop"))
    assert [r["step"] for r in rows] == [0]
    pid = killed["engine_pid"]  # an engine actor was killed while generating
    assert not psutil.pid_exists(pid) or \
        psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # its engine died with it
    # No group lost with the engine. Its request in flight was sent again to the other engine,
    # or retried at the restarted actor's URL, or it had just finished: which depends on timing.
    assert rows[0]["rollout/num_samples"] == 16
    # After the step's sync both engines (the restarted one too) serve the new version.
    assert served == [{str(result["policy_version"])}] and result["policy_version"] >= 1
    # Cleanup: no actor, no placement group left; Ray itself is the fixture's.
    assert not [a for a in ray.util.list_named_actors() if a.startswith(ACTOR_PREFIX)]
    groups = ray.util.placement_group_table().values()
    assert all(g["state"] == "REMOVED" for g in groups)
