"""`rltool doctor`: what this machine can run.

`diagnose()` returns the versions of the packages rltool's tiers rely on, the GPUs and their
memory, whether the native kernels are built, and for each tier whether it can run here and, when
it cannot, why (with the fix). It imports each optional package to find out, and only reports:
nothing is written and no process is started.

Tiers:
- cpu: the builtin engine over transformers on the CPU and the torch trainer (everything the
  tests run);
- gpu: the builtin engine's own paged-KV CUDA engine (Triton kernels, CUDA graphs) and the torch
  trainer on one GPU;
- megatron: megatron-core for torch_dist checkpoints (`rltool convert`; on a machine without CUDA
  through rltool.megatron_compat), transformer-engine reported alongside;
- sglang: `rltool serve --engine sglang`, which needs the sglang package and a CUDA GPU.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import platform
import warnings
from typing import Any

from rltool import __version__, native

# name shown -> (distribution name, module to import or None to check it is findable only)
PACKAGES: dict[str, tuple[str, str | None]] = {
    "torch": ("torch", "torch"),
    "transformers": ("transformers", "transformers"),
    "triton": ("triton", "triton"),
    "megatron-core": ("megatron-core", "megatron.core"),
    # Importing these two pulls in CUDA libraries (and fails without them): found, not imported.
    "sglang": ("sglang", None),
    "transformer-engine": ("transformer-engine", None),
    "ray": ("ray", "ray"),
    "tensorboard": ("tensorboard", None),
    "wandb": ("wandb", None),
}
NOT_INSTALLED = "not installed"


def package_status(dist: str, module: str | None) -> dict[str, Any]:
    """{"version": str | None, "status": "ok" | "not installed" | "broken: <error>"}."""
    try:
        version: str | None = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    top = (module or dist.replace("-", "_")).split(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if version is None and not found:
        return {"version": None, "status": NOT_INSTALLED}
    if module is not None:
        try:
            # Their import-time warnings and INFO lines (megatron's "Transformer Engine and Apex
            # are not installed") would bury the report; the status says what matters.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                logging.disable(logging.INFO)
                try:
                    imported = importlib.import_module(module)
                finally:
                    logging.disable(logging.NOTSET)
        except Exception as e:  # noqa: BLE001 - any import failure is what doctor reports
            return {"version": version, "status": f"broken: {type(e).__name__}: {e}"}
        version = version or getattr(imported, "__version__", None)
    return {"version": version, "status": "ok"}


def gpus() -> dict[str, Any]:
    """CUDA as torch sees it: its build, whether a device is usable, and each device's memory."""
    import torch

    info: dict[str, Any] = {"torch_cuda": torch.version.cuda, "available": False, "devices": []}
    if torch.version.cuda is None:
        info["reason"] = f"torch {torch.__version__} is a CPU-only build"
        return info
    if not torch.cuda.is_available():
        info["reason"] = "torch has CUDA but sees no usable device (driver, CUDA_VISIBLE_DEVICES)"
        return info
    info["available"] = True
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        info["devices"].append({"index": i, "name": props.name,
                                "memory_gib": round(props.total_memory / 2**30, 1),
                                "capability": f"{props.major}.{props.minor}"})
    return info


def tiers(packages: dict[str, dict[str, Any]], cuda: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """For each tier: {"ok": bool, "why": str} (why it cannot run, or what it runs on)."""

    def missing(*names: str) -> str | None:
        bad = [f"{n} {packages[n]['status']}" for n in names if packages[n]["status"] != "ok"]
        return "; ".join(bad) or None

    no_gpu = None if cuda["available"] else f"no CUDA GPU: {cuda['reason']}"
    out: dict[str, dict[str, Any]] = {}
    problem = missing("torch", "transformers")
    out["cpu"] = {"ok": problem is None,
                  "why": problem or "builtin engine over transformers, torch trainer"}
    problem = missing("torch", "triton") or no_gpu
    out["gpu"] = {"ok": problem is None,
                  "why": problem or f"{len(cuda['devices'])} GPU(s): paged CUDA engine, torch "
                  "trainer"}
    problem = missing("megatron-core")
    if problem:
        problem += "; install it with pip install 'rltool[megatron]'"
    te = packages["transformer-engine"]
    out["megatron"] = {
        "ok": problem is None,
        "why": problem or ("torch_dist conversion" + ("" if cuda["available"] else
                                                       " on the CPU (megatron_compat)")
                           + f"; transformer-engine {te['version'] or NOT_INSTALLED}")}
    problem = missing("sglang")
    if problem:
        problem += "; install it with pip install 'rltool[sglang]'"
    problem = "; ".join(p for p in (problem, no_gpu) if p) or None
    out["sglang"] = {"ok": problem is None,
                     "why": problem or f"sglang {packages['sglang']['version']} on "
                     f"{len(cuda['devices'])} GPU(s)"}
    return out


def diagnose() -> dict[str, Any]:
    """The whole report, as a JSON-ready dict."""
    packages = {name: package_status(dist, module) for name, (dist, module) in PACKAGES.items()}
    cuda = gpus() if packages["torch"]["status"] == "ok" else {
        "torch_cuda": None, "available": False, "devices": [], "reason": "torch not importable"}
    path = native.library_path()
    return {
        "python": platform.python_version(),
        "rltool": __version__,
        "packages": packages,
        "cuda": cuda,
        "native_kernels": {"built": path is not None, "path": str(path) if path else None,
                           "loaded": native.load() is not None},
        "tiers": tiers(packages, cuda),
    }
