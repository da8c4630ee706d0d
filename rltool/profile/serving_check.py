"""Serving models checked against live engine runs (`rltool plan --check-engine URL
--baseline-engine URL`).

The interface: a serving model that can be checked is a `Checkable`. From the answers of live
engines (their `/get_server_info`, by role) it measures the quantities the model takes and,
separately, the quantity the model predicts; from the quantities alone it predicts. `run_check`
replaces measured inputs with the ones the user gave (flags named like the plan's inputs), asks
for the prediction and compares it with the measurement: a `ModelCheck`, which passes when the
relative error is within the tolerance. A measured input and the measured outcome never come
from the same counter, so a wrong model (or a wrong input) shows.

The HiCache model (rltool.profile.caches.hicache: dt = h*t_prefill - t_io - t_book per request,
t_io = h*L*c_A/B_io) is checked by `HiCacheCheck` on two engines that served the same workload:
`tiered` with the host KV tier, `baseline` without it. Inputs, from their `hicache` counters
(rltool/engine/host_kv.py, TierStats): h = host-hit prompt tokens / prompt tokens (tiered);
L = prompt tokens / requests; t_prefill = L * the marginal prefill cost of a token, the slope of
a least-squares fit of each prefill forward's seconds against its tokens over both engines (a
hit saves that, not the mean, which also carries each forward's fixed cost); B_io = bytes
reloaded / reload copy seconds (tiered); t_book = the tier's bookkeeping seconds / requests;
c_A from config.json. Outcome: mean time to first
token of the baseline minus the tiered one's. The model is per request with nothing queued:
the workload must send one request at a time (queueing adds the saving of every request ahead).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rltool.errors import BadInputError
from rltool.profile import caches
from rltool.profile.modelcfg import ModelShape, load_shape

HICACHE_TOLERANCE = 0.2


@dataclass(frozen=True)
class Quantity:
    """One number of a check and where it came from (an engine counter, or a flag)."""
    name: str
    value: float
    source: str


@dataclass(frozen=True)
class ModelCheck:
    """A model's prediction from `inputs` against a run's measurement of the same thing."""
    model: str
    inputs: tuple[Quantity, ...]
    predicted: Quantity
    measured: Quantity
    tolerance: float
    context: dict[str, Any] = field(default_factory=dict)  # reported, not used by the model

    @property
    def relative_error(self) -> float:
        m = self.measured.value
        if m:
            return (self.predicted.value - m) / abs(m)
        return 0.0 if self.predicted.value == m else float("inf")

    @property
    def passed(self) -> bool:
        return abs(self.relative_error) <= self.tolerance

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "inputs": [asdict(q) for q in self.inputs],
                "predicted": asdict(self.predicted), "measured": asdict(self.measured),
                "relative_error": self.relative_error, "tolerance": self.tolerance,
                "passed": self.passed, "context": self.context}


class Checkable(Protocol):
    """A serving model that live runs can check."""

    name: str
    roles: tuple[str, ...]  # the engines it needs, by role

    def measure(self, runs: Mapping[str, dict[str, Any]]
                ) -> tuple[dict[str, Quantity], Quantity, dict[str, Any]]:
        """From each role's /get_server_info: the model's inputs, the measured outcome, and
        context worth reporting."""

    def predict(self, inputs: Mapping[str, float]) -> Quantity:
        """The outcome the model predicts from its inputs alone."""


def run_check(model: Checkable, runs: Mapping[str, dict[str, Any]], *,
              overrides: Mapping[str, float] | None = None,
              tolerance: float) -> ModelCheck:
    """Measure, replace the inputs named in `overrides` (an unknown name is bad input), predict
    and compare."""
    inputs, measured, context = model.measure(runs)
    for name, value in (overrides or {}).items():
        if name not in inputs:
            raise BadInputError(f"the {model.name} model takes no input {name!r}; it takes "
                                f"{', '.join(inputs)}")
        inputs[name] = Quantity(name, float(value), "flag")
    predicted = model.predict({k: q.value for k, q in inputs.items()})
    return ModelCheck(model.name, tuple(inputs.values()), predicted, measured, tolerance,
                      context)


@dataclass
class HiCacheCheck:
    """The HiCache model against a `tiered` engine and a `baseline` one (see the module)."""

    shape: ModelShape
    kv_bits: int
    name: str = "hicache"
    roles: tuple[str, ...] = ("tiered", "baseline")

    def measure(self, runs: Mapping[str, dict[str, Any]]
                ) -> tuple[dict[str, Quantity], Quantity, dict[str, Any]]:
        t, b = (_tier_stats(runs[r], r) for r in self.roles)
        if not t["host_pages"]:
            raise BadInputError("the tiered engine has no host KV tier; start it with "
                                "--enable-hierarchical-cache")
        if b["host_pages"]:
            raise BadInputError("the baseline engine has a host KV tier; start it without "
                                "--enable-hierarchical-cache")
        if (t["requests"], t["prompt_tokens"]) != (b["requests"], b["prompt_tokens"]):
            raise BadInputError(f"the engines served different workloads ({t['requests']} "
                                f"requests, {t['prompt_tokens']} prompt tokens tiered; "
                                f"{b['requests']}, {b['prompt_tokens']} baseline); send both "
                                "the same requests")
        if not t["requests"] or not t["io_to_device_s"]:
            raise BadInputError("the tiered engine reloaded nothing from its host tier; run a "
                                "workload whose shared prefixes overflow the device pool "
                                "(--max-total-tokens) before checking")
        n = t["requests"]
        tokens = t["prompt_tokens"] / n
        per_token = marginal_s_per_token([t, b])
        if per_token is None or per_token <= 0:
            raise BadInputError("the engines' prefill forwards give no positive cost per token "
                                "(too few forwards of different sizes); run a longer workload")
        inputs = {
            "hit_rate": Quantity("hit_rate", t["host_hit_tokens"] / t["prompt_tokens"],
                                 "tiered: host_hit_tokens / prompt_tokens"),
            "prompt_tokens": Quantity("prompt_tokens", tokens, "tiered: prompt_tokens / requests"),
            "t_prefill_s": Quantity("t_prefill_s", tokens * per_token,
                                    "L * both: slope of prefill seconds on tokens per forward"),
            "B_io_GBps": Quantity("B_io_GBps", t["bytes_to_device"] / t["io_to_device_s"] / 1e9,
                                  "tiered: bytes_to_device / io_to_device_s"),
            "t_book_s": Quantity("t_book_s", t["book_s"] / n, "tiered: book_s / requests")}
        measured = Quantity("dt_s", b["ttft_mean_s"] - t["ttft_mean_s"],
                            "baseline ttft_mean_s - tiered ttft_mean_s")
        context = {"requests": n, "ttft_mean_s": {"tiered": t["ttft_mean_s"],
                                                  "baseline": b["ttft_mean_s"]},
                   "ttft_p50_s": {"tiered": t["ttft_p50_s"], "baseline": b["ttft_p50_s"]},
                   "ttft_p99_s": {"tiered": t["ttft_p99_s"], "baseline": b["ttft_p99_s"]},
                   "device_hit_tokens": {"tiered": t["device_hit_tokens"],
                                         "baseline": b["device_hit_tokens"]},
                   "bytes_to_host": t["bytes_to_host"], "io_to_host_s": t["io_to_host_s"],
                   "reloads": t["reloads"],
                   "prefill_s_per_token_mean": {"tiered": t["prefill_s_per_token"],
                                                "baseline": b["prefill_s_per_token"]}}
        return inputs, measured, context

    def predict(self, inputs: Mapping[str, float]) -> Quantity:
        row = caches.hicache(self.shape, hit_rate=inputs["hit_rate"],
                             prompt_tokens=inputs["prompt_tokens"],
                             t_prefill_s=inputs["t_prefill_s"],
                             io_Bps=inputs["B_io_GBps"] * 1e9, t_book_s=inputs["t_book_s"],
                             kv_bits=self.kv_bits, version_lifetime_s=0.0)["rows"][0]
        return Quantity("dt_s", row["saved_per_request_s"],
                        "h*t_prefill - h*L*c_A/B_io - t_book")


def hicache_check(tiered: dict[str, Any], baseline: dict[str, Any], *,
                  overrides: Mapping[str, float] | None = None,
                  tolerance: float = HICACHE_TOLERANCE,
                  model: str | Path | None = None) -> ModelCheck:
    """The HiCache model against two builtin engines' /get_server_info answers; `model`: the
    config.json (or its folder) to take c_A from (default: the tiered engine's model_path)."""
    from rltool.profile.engine_check import kv_bits

    model_dir = Path(model) if model is not None else Path(tiered["model_path"])
    check = HiCacheCheck(load_shape(model_dir), kv_bits(tiered))
    return run_check(check, {"tiered": tiered, "baseline": baseline}, overrides=overrides,
                     tolerance=tolerance)


def _tier_stats(info: dict[str, Any], role: str) -> dict[str, Any]:
    stats = info.get("hicache")
    if info.get("engine") != "builtin" or not isinstance(stats, dict) or "requests" not in stats:
        raise BadInputError(f"the {role} engine does not report hicache counters; the check "
                            "needs `rltool serve --engine builtin` engines")
    return stats


_SUMMED = ("device_hit_tokens", "host_hit_tokens", "bytes_to_host", "bytes_to_device",
           "io_to_host_s", "io_to_device_s", "reloads", "book_s", "requests", "prompt_tokens",
           "ttft_s", "prefill_forwards", "prefill_tokens", "prefill_s", "prefill_tokens_sq",
           "prefill_token_s")


def marginal_s_per_token(stats: list[dict[str, Any]]) -> float | None:
    """The least-squares slope of prefill seconds against tokens over the prefill forwards of
    engines whose `hicache` counters are `stats` (None without two distinct sizes): what a
    token more costs, the fixed cost of a forward left out."""
    n, x, y, xx, xy = (sum(s[k] for s in stats) for k in (
        "prefill_forwards", "prefill_tokens", "prefill_s", "prefill_tokens_sq",
        "prefill_token_s"))
    spread = n * xx - x * x
    if n < 2 or spread <= 0:
        return None
    return (n * xy - x * y) / spread


def counters_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """`after` (a /get_server_info answer) with its `hicache` counters counted from `before`
    (an earlier answer of the same engine), so a check covers one workload of an engine that
    served others first (a warm-up); the windowed TTFT percentiles are dropped (None)."""
    b, a = _tier_stats(before, "earlier"), _tier_stats(after, "later")
    stats = dict(a) | {k: a[k] - b[k] for k in _SUMMED}
    stats.update(io_s=stats["io_to_host_s"] + stats["io_to_device_s"],
                 ttft_mean_s=stats["ttft_s"] / stats["requests"] if stats["requests"] else None,
                 prefill_s_per_token=(stats["prefill_s"] / stats["prefill_tokens"]
                                      if stats["prefill_tokens"] else None),
                 ttft_p50_s=None, ttft_p99_s=None)
    return after | {"hicache": stats}
