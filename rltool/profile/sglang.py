"""SGLang deployment files from a plan: the YAML that slime's `--sglang-config` reads (prefill
and decode server groups) and `serving-reference.sh`, the equivalent SGLang launch commands for a
deployment run outside slime.

Format followed: slime's `SglangConfig.from_yaml` at THUDM/slime commit 1e8bafac (a top-level
`sglang:` list of models, each with `name`, `model_path`, `update_weights`, `num_gpus_per_engine`
and `server_groups` of `worker_type` (regular, prefill, decode, placeholder, encoder), `num_gpus`,
`num_gpus_per_engine`, `overrides` (SGLang ServerArgs fields)). The rules it enforces are checked
here first, so a file `plan` writes is one slime accepts; hierarchical cache goes on the prefill
group only.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltool import atomic
from rltool.errors import BadInputError


@dataclass
class ServerGroup:
    worker_type: str
    num_gpus: int
    num_gpus_per_engine: int
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def engines(self) -> int:
        return self.num_gpus // self.num_gpus_per_engine


def pd_groups(*, rollout_gpus: int, gpus_per_engine: int, gpus_per_node: int, prefill_engines: int,
              hicache: bool, engine_urls: list[str] | None = None) -> list[ServerGroup]:
    """Prefill and decode groups over the rollout pool; every rule has its error."""
    if engine_urls:
        raise BadInputError("--emit-sglang-config describes engines for slime to launch; it "
                            "cannot be combined with external engine addresses (--engine-urls)")
    if gpus_per_engine <= 0 or rollout_gpus <= 0:
        raise BadInputError("--rollout-gpus and --engine-tp must be > 0 for an SGLang config")
    if rollout_gpus % gpus_per_engine:
        raise BadInputError(f"--rollout-gpus {rollout_gpus} is not a multiple of --engine-tp "
                            f"{gpus_per_engine}; every group must be whole engines")
    if gpus_per_engine > gpus_per_node and gpus_per_engine % gpus_per_node:
        raise BadInputError(f"--engine-tp {gpus_per_engine} spans nodes but is not a multiple of "
                            f"--gpus-per-node {gpus_per_node}")
    engines = rollout_gpus // gpus_per_engine
    if engines < 2:
        raise BadInputError(f"{engines} engine(s) in the rollout pool: PD needs at least one "
                            "prefill and one decode engine; raise --rollout-gpus")
    if not 1 <= prefill_engines < engines:
        raise BadInputError(f"{prefill_engines} prefill engines of {engines}: must leave at least "
                            "one decode engine and use at least one prefill engine")
    # The worker type sets each engine's disaggregation mode; overrides carry the rest.
    prefill = {"enable_hierarchical_cache": True} if hicache else {}
    return [ServerGroup("prefill", prefill_engines * gpus_per_engine, gpus_per_engine, prefill),
            ServerGroup("decode", (engines - prefill_engines) * gpus_per_engine, gpus_per_engine)]


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_yaml(groups: list[ServerGroup], *, model_path: str, name: str = "actor") -> str:
    lines = ["sglang:", f"  - name: {name}", f"    model_path: {_scalar(model_path)}",
             "    update_weights: true", "    server_groups:"]
    for g in groups:
        lines += [f"      - worker_type: {g.worker_type}", f"        num_gpus: {g.num_gpus}",
                  f"        num_gpus_per_engine: {g.num_gpus_per_engine}"]
        if g.overrides:
            lines.append("        overrides:")
            lines += [f"          {k}: {_scalar(v)}" for k, v in g.overrides.items()]
    return "\n".join(lines) + "\n"


def serving_reference(groups: list[ServerGroup], *, model_path: str, gpus_per_node: int,
                      host: str = "127.0.0.1", base_port: int = 30000) -> str:
    """A shell script with one `sglang.launch_server` per engine (GPUs numbered within each
    node) and the PD router in front of them."""
    lines = ["#!/usr/bin/env bash", "# SGLang launch commands equivalent to the sglang config "
             "next to this file. Run each engine's line on the node named before it.",
             "set -euo pipefail", f"MODEL={shlex.quote(model_path)}"]
    gpu, port, urls = 0, base_port, {"prefill": [], "decode": []}
    for g in groups:
        for _ in range(g.engines):
            node, first = divmod(gpu, gpus_per_node)
            devices = ",".join(str(first + i) for i in range(min(g.num_gpus_per_engine,
                                                                 gpus_per_node)))
            flags = [f"--tp-size {g.num_gpus_per_engine}", f"--host {host}", f"--port {port}",
                     f"--disaggregation-mode {g.worker_type}"]
            if g.overrides.get("enable_hierarchical_cache"):
                flags.append("--enable-hierarchical-cache")
            lines.append(f"# node {node}")
            lines.append(f"CUDA_VISIBLE_DEVICES={devices} python -m sglang.launch_server "
                         f"--model-path \"$MODEL\" {' '.join(flags)} &")
            urls[g.worker_type].append(f"http://{host}:{port}")
            gpu += g.num_gpus_per_engine
            port += 1
    router = ["python -m sglang_router.launch_router --pd-disaggregation"]
    router += [f"--prefill {u}" for u in urls["prefill"]]
    router += [f"--decode {u}" for u in urls["decode"]]
    router += [f"--host {host}", f"--port {port}"]
    lines += [" ".join(router) + " &", "wait"]
    return "\n".join(lines) + "\n"


def write_deployment(out: str | Path, groups: list[ServerGroup], *, model_path: str,
                     gpus_per_node: int) -> dict[str, str]:
    """Write OUT (the YAML) and serving-reference.sh beside it; both or neither."""
    out = Path(out)
    if not out.parent.is_dir():
        raise BadInputError(f"--emit-sglang-config {out}: folder {out.parent} does not exist")
    script_text = serving_reference(groups, model_path=model_path, gpus_per_node=gpus_per_node)
    yaml_text = config_yaml(groups, model_path=model_path)
    script = out.parent / "serving-reference.sh"
    atomic.write_text(script, script_text)
    script.chmod(0o755)
    atomic.write_text(out, yaml_text)
    return {"sglang_config": str(out), "serving_reference": str(script)}
