"""`rltool plan --check-engine URL`: the hybrid-cache model (rltool.profile.caches.hybrid_cache)
against what a live builtin engine allocated, from its /get_server_info answer (the command
fetches it).

The plan computes c_A and c_R from config.json alone (rltool.profile.modelcfg) and splits a budget
B into B_A = B/(1+r) for KV and B_R = rB/(1+r) for recurrent states; the engine reports the c_A,
c_R, K slots and N tokens of the pools it built (`cache_sizes`). The budget the engine split is
the one its docs define: on cpu `--max-total-tokens`·c_A + `--max-running-requests`·c_R (a pool
of the asked size never gets more than asked: N ≤ --max-total-tokens, K ≤ --max-running-requests);
on cuda what `--mem-fraction-static` left, which the engine does not report, so B is taken from
its KV side, N·c_A·(1+r), and only K is a prediction there. Each number must agree within
`TOLERANCE` (N loses the engine's scratch page and rounds to whole pages).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rltool.errors import BadInputError
from rltool.profile.caches import hybrid_cache
from rltool.profile.modelcfg import load_shape
from rltool.profile.models import GIB

TOLERANCE = 0.02
_BITS = {"fp32": 32, "float32": 32, "bf16": 16, "bfloat16": 16, "fp16": 16, "float16": 16}
CUDA_RATIO = 0.9  # the engine's default --mamba-full-memory-ratio on cuda (SGLang's)


def _bits(name: str | None, what: str) -> int:
    if name not in _BITS:
        raise BadInputError(f"the engine reports {what} {name!r}; --check-engine knows "
                            f"{', '.join(sorted(_BITS))}")
    return _BITS[name]


def kv_bits(info: dict[str, Any]) -> int:
    """Bits per element of the KV pool of the engine whose /get_server_info answered `info`."""
    if info.get("kv_cache_dtype") == "fp8_e4m3":
        return 8
    return _bits(info.get("dtype") or info.get("weight_dtype"), "dtype")


def check_engine(info: dict[str, Any], *, url: str, model: str | Path | None = None,
                 tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Each hybrid-cache prediction for the engine at `url`, whose /get_server_info answered
    `info`, against what it allocated; `model`: the config.json (or its folder) to plan from
    (default: the engine's model_path)."""
    import json

    sizes = info.get("cache_sizes")
    if info.get("engine") != "builtin" or not isinstance(sizes, dict):
        raise BadInputError(f"{url} does not report cache_sizes; --check-engine needs an "
                            "`rltool serve --engine builtin` engine")
    model_dir = Path(model) if model is not None else Path(info["model_path"])
    shape = load_shape(model_dir)
    config = model_dir / "config.json" if model_dir.is_dir() else model_dir
    ssm = info.get("mamba_ssm_dtype") or json.loads(config.read_text()).get("mamba_ssm_dtype")
    dtype_bits = _bits(info.get("dtype") or info.get("weight_dtype"), "dtype")
    kv = kv_bits(info)
    ssm_bits = _bits(ssm or "fp32", "mamba_ssm_dtype")
    max_running = int(info["max_running_requests"])
    ratio = info.get("mamba_full_memory_ratio")
    cpu = info.get("device") == "cpu"
    probe = hybrid_cache(shape, tokens=0, sequences=0, pool_gib=1.0, ratio=1.0, kv_bits=kv,
                         ssm_bits=ssm_bits, conv_bits=dtype_bits)["rows"][0]
    c_a, c_r = probe["c_A_bytes_per_token"], probe["c_R_bytes_per_sequence"]
    if cpu:
        tokens = info.get("max_total_tokens") or max_running * min(info["context_length"], 4096)
        budget = tokens * c_a + max_running * c_r
        basis = "cpu: B = --max-total-tokens*c_A + --max-running-requests*c_R"
    else:
        ratio = ratio or CUDA_RATIO
        tokens = sizes["N"]
        budget = sizes["N"] * c_a * (1 + ratio)
        basis = "cuda: B = N*c_A*(1+r), the engine's KV pool taken as B/(1+r)"
    if c_r and ratio is not None:
        row = hybrid_cache(shape, tokens=tokens, sequences=max_running, pool_gib=budget / GIB,
                           ratio=ratio, kv_bits=kv, ssm_bits=ssm_bits,
                           conv_bits=dtype_bits)["rows"][0]
        n, k = min(tokens, row["max_tokens"]), min(max_running, row["max_sequences"])
    else:  # cpu without a ratio (or no recurrent state): the asked pool and a slot per request
        n, k = tokens, max_running if c_r else 0
    checks = [_row("c_A (KV bytes per token)", c_a, sizes["c_A"], tolerance),
              _row("c_R (state bytes per sequence)", c_r, sizes["c_R"], tolerance),
              _row("K (state slots)", k, sizes["K"], tolerance),
              _row("B_cache = N*c_A + K*c_R (bytes)", n * c_a + k * c_r,
                   sizes["N"] * sizes["c_A"] + sizes["K"] * sizes["c_R"], tolerance)]
    if cpu:
        checks.insert(3, _row("N (KV tokens)", n, sizes["N"], tolerance))
    return {"engine": url, "model_config": str(config), "budget_basis": basis,
            "ratio_r": ratio, "budget_bytes": budget, "tolerance": tolerance, "checks": checks,
            "passed": all(c["within_tolerance"] for c in checks)}


def _row(name: str, predicted: float, measured: float, tolerance: float) -> dict[str, Any]:
    if measured:
        rel = (predicted - measured) / measured
    else:
        rel = 0.0 if predicted == measured else float("inf")
    return {"prediction": name, "predicted": predicted, "measured": measured,
            "relative_error": rel, "within_tolerance": abs(rel) <= tolerance}
