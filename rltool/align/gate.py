"""The train-vs-rollout logprob gate: `run(cfg) -> GateResult` and the lighter `check(...)`.

1. Read and verify the inputs before building any model (bad input changes nothing, exit 2):
   the weights directory, the shards (manifest, checksums, schema, tokenizer hash of the weights),
   and the per-token weight versions against the version the weights declare.
2. Recompute the logprob of every response token with the trainer's own path
   (`rltool.train.stage.recompute_logprobs`: same reader, same DP micro-batch schedule per global
   batch, same temperature convention, same dtype and deterministic layout as training).
3. Compare with the shards' rollout_logprobs on loss-masked tokens:
   train_rollout_logprob_abs_diff = mean over samples (with >= 1 masked token) of the per-sample
   mean |train - rollout| -- the definition of the trainer's train/ metric of the same name --
   plus the max |diff|, a histogram by decade, and the worst samples and token positions.
4. Optionally (`layerwise`) compare per-layer hidden states of the worst samples between the
   engine (its debug endpoint) and the trainer model (rltool.align.layerwise).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rltool.align.config import DEFAULT_TOL, AlignGateConfig
from rltool.errors import BadInputError, CheckpointError, ShardSchemaError
from rltool.rundir import declared_version

log = logging.getLogger(__name__)
METRIC = "train_rollout_logprob_abs_diff"
# Histogram of per-token |diff| by decade: [0, 0] exactly, then (0, 1e-9), [1e-9, 1e-8), ...,
# [1e-1, 1), [1, inf).
HISTOGRAM_EDGES = [0.0] + [10.0 ** e for e in range(-9, 1)] + [math.inf]
READ_COLUMNS = ["uid", "prompt_token_ids", "response_token_ids", "rollout_logprobs", "loss_mask",
                "weight_versions"]


@dataclass
class SampleRef:
    """One shard row the gate compares (what it needs of it, in shard order)."""

    uid: str
    shard: str
    row: int
    token_ids: list[int]          # prompt + response
    response_start: int
    rollout_logprobs: list[float]
    loss_mask: list[int]


@dataclass
class Inputs:
    """Verified inputs: the model directory, the samples and the versions seen."""

    model_dir: Path
    weights_version: int | None   # None when the weights declare no version
    shard_versions: list[int]     # distinct per-token versions in the shards (-1 ignored)
    samples: list[SampleRef]
    # distinct (device, dtype) of the engines that sampled the shards, where they report them
    engine_precisions: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class GateResult:
    metric: float                 # train_rollout_logprob_abs_diff
    max_abs_diff: float
    tol: float
    passed: bool
    num_samples: int
    num_masked_tokens: int
    histogram: list[dict[str, Any]]
    worst_samples: list[dict[str, Any]]
    worst_positions: list[dict[str, Any]]
    weights_version: int | None
    shard_versions: list[int]
    recompute_s: float
    layerwise: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        from rltool.errors import EXIT_CHECK_FAILED, EXIT_OK

        return EXIT_OK if self.passed else EXIT_CHECK_FAILED

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out[METRIC] = out.pop("metric")
        return out


def load_inputs(shard_dirs: list[str | Path], weights_dir: str | Path, *,
                allow_version_mismatch: bool = False) -> Inputs:
    """Verify weights, shards, tokenizer and versions; read what the comparison needs."""
    from rltool.data.shards import open_shard
    from rltool.data.tokenizer import tokenizer_hash
    from rltool.errors import BadInputError
    from rltool.train.checkpoint import resolve_load

    weights = Path(weights_dir)
    if not weights.is_dir():
        raise CheckpointError(f"--weights {weights}: no such directory; pass the weights the "
                              "rollouts were sampled with (e.g. RUN/weights/weight_vNNNNNN)")
    try:
        target = resolve_load(weights)
    except CheckpointError as e:  # its message names train's --load; here the flag is --weights
        raise CheckpointError(str(e).replace("--load", "--weights", 1)) from e
    version = (target.version if target.ckpt_dir is not None
               else declared_version(target.model_dir))
    expected_hash = tokenizer_hash(target.model_dir)
    samples: list[SampleRef] = []
    versions: set[int] = set()
    precisions: set[tuple[str, str]] = set()
    for d in shard_dirs:
        shard = open_shard(d, expected_tokenizer_hash=expected_hash)
        for p in (shard.meta.extra.get("engine_precision") or {}).values():
            if isinstance(p, dict) and p.get("device") and p.get("dtype"):
                precisions.add((str(p["device"]), str(p["dtype"])))
        row = 0
        for batch in shard.iter_batches(columns=READ_COLUMNS):
            for r in batch.to_pylist():
                versions.update(v for v in r["weight_versions"] if v != -1)
                prompt = r["prompt_token_ids"]
                samples.append(SampleRef(uid=r["uid"], shard=str(d), row=row,
                                         token_ids=prompt + r["response_token_ids"],
                                         response_start=len(prompt),
                                         rollout_logprobs=r["rollout_logprobs"],
                                         loss_mask=r["loss_mask"]))
                row += 1
    if not samples:
        raise ShardSchemaError(f"{', '.join(map(str, shard_dirs))}: no rows to compare")
    other = sorted(versions - {version}) if version is not None else []
    if other and not allow_version_mismatch:
        raise BadInputError(
            f"--weights {weights} declares version {version} but the shards' tokens were sampled "
            f"with version(s) {other}; pass the weights that produced them, or "
            "--allow-version-mismatch to measure the gap anyway")
    return Inputs(model_dir=target.model_dir, weights_version=version,
                  shard_versions=sorted(versions), samples=samples,
                  engine_precisions=sorted(precisions))


def recompute_precision(cfg: AlignGateConfig, recorded: list[tuple[str, str]]
                        ) -> tuple[str, str]:
    """(device, dtype) the trainer path recomputes with. `--device auto` follows the device and
    dtype of the engines recorded in the shards (an explicit --dtype wins); without a record it
    stays auto (CUDA when torch sees one)."""
    if cfg.device != "auto" or not recorded:
        return cfg.device, cfg.dtype
    if len(recorded) > 1:
        raise BadInputError(f"--device auto: the shards were sampled by engines of different "
                            f"precisions {recorded}; pass --device and --dtype")
    device, dtype = recorded[0]
    if "dtype" in cfg.model_fields_set:
        dtype = cfg.dtype
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BadInputError("--device auto: the shards were sampled on CUDA but torch sees "
                                "no GPU here; run the gate on the engine's host, or pass "
                                "--device cpu to recompute on the CPU anyway")
    if device not in ("cpu", "cuda") or dtype not in ("fp32", "bf16"):
        raise BadInputError(f"--device auto: the shards record engine precision "
                            f"{device}/{dtype}, which the trainer path cannot use; pass "
                            "--device and --dtype")
    return device, dtype


def compare(samples: list[SampleRef], train_logprobs: list[list[float]], *, tol: float,
            num_worst: int = 5) -> dict[str, Any]:
    """The gate's numbers from the trainer's logprobs (indexed like `samples`)."""
    import torch

    if len(train_logprobs) != len(samples):
        raise AssertionError(f"{len(train_logprobs)} recomputed samples for {len(samples)} rows")
    width = max(len(s.loss_mask) for s in samples)
    shape = (len(samples), max(width, 1))
    train = torch.zeros(shape, dtype=torch.float64)
    rollout = torch.zeros(shape, dtype=torch.float64)
    mask = torch.zeros(shape, dtype=torch.bool)
    for i, (s, lp) in enumerate(zip(samples, train_logprobs)):
        n = len(s.loss_mask)
        if len(lp) != n:
            raise AssertionError(f"sample {s.uid}: {len(lp)} recomputed logprobs for {n} tokens")
        train[i, :n] = torch.tensor(lp, dtype=torch.float64)
        rollout[i, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float64)
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
    # Both sides are float32 values; their difference is exact in float64.
    diff = torch.where(mask, (train - rollout).abs(), torch.zeros((), dtype=torch.float64))
    count = mask.sum(-1)
    per_sample = diff.sum(-1) / count.clamp_min(1)
    has = count > 0
    metric = float(per_sample[has].mean()) if bool(has.any()) else 0.0
    max_abs = float(diff.max()) if bool(mask.any()) else 0.0
    # Stable descending sorts: ties keep shard order, NaN (a broken recompute) sorts first.
    order = torch.sort(per_sample, descending=True, stable=True).indices.tolist()
    worst_samples = []
    for i in order[:num_worst]:
        s = samples[i]
        pos = int(diff[i].argmax())
        worst_samples.append({
            "uid": s.uid, "shard": s.shard, "row": s.row, "sample": i,
            "mean_abs_diff": float(per_sample[i]), "max_abs_diff": float(diff[i, pos]),
            "max_position": pos, "num_masked_tokens": int(count[i])})
    flat = diff[mask]
    positions = mask.nonzero().tolist()
    top = torch.sort(flat, descending=True, stable=True).indices[:num_worst].tolist()
    worst_positions = []
    for k in top:
        i, t = positions[k]
        s = samples[i]
        worst_positions.append({
            "uid": s.uid, "sample": i, "position": t,
            "token_id": s.token_ids[s.response_start + t], "abs_diff": float(flat[k]),
            "train_logprob": float(train[i, t]), "rollout_logprob": float(rollout[i, t])})
    return {"metric": metric, "max_abs_diff": max_abs, "passed": metric <= tol,
            "num_masked_tokens": int(count.sum()), "histogram": histogram(flat.tolist()),
            "worst_samples": worst_samples, "worst_positions": worst_positions,
            "order": order}


def histogram(values: list[float]) -> list[dict[str, Any]]:
    """Counts of |diff| per decade bin (HISTOGRAM_EDGES); exact zeros have their own bin."""
    bins = [{"low": 0.0, "high": 0.0, "count": 0}]
    bins += [{"low": lo, "high": hi, "count": 0}
             for lo, hi in zip(HISTOGRAM_EDGES[:-1], HISTOGRAM_EDGES[1:])]
    for v in values:
        if v == 0.0:
            bins[0]["count"] += 1
        elif not math.isnan(v):
            k = bisect.bisect_right(HISTOGRAM_EDGES, v)  # edges[k-1] <= v < edges[k]
            bins[min(k, len(bins) - 1)]["count"] += 1
    return bins


def check(shard_dirs: list[str | Path], weights_dir: str | Path, *, tol: float = DEFAULT_TOL,
          deterministic: bool = False, dtype: str = "fp32", max_tokens_per_microbatch: int = 4096,
          global_batch_size: int | None = None, allow_version_mismatch: bool = False,
          num_worst: int = 5, device: str = "cpu", backend: str = "torch") -> GateResult:
    """The logprob gate without layerwise, report file or config file (what the loop calls).

    Raises BadInputError (and subclasses) on bad input; returns a GateResult whose `passed`
    says whether train_rollout_logprob_abs_diff <= tol.
    """
    return run(AlignGateConfig(
        rollouts=[str(d) for d in shard_dirs], weights=str(weights_dir), tol=tol,
        deterministic=deterministic, dtype=dtype,
        max_tokens_per_microbatch=max_tokens_per_microbatch,
        global_batch_size=global_batch_size, allow_version_mismatch=allow_version_mismatch,
        num_worst=num_worst, device=device, backend=backend))


def run(cfg: AlignGateConfig) -> GateResult:
    """Run the gate (module docstring). The caller turns `passed` into exit 0/1."""
    from rltool.train.stage import recompute_logprobs

    inputs = load_inputs(cfg.rollouts, cfg.weights,
                         allow_version_mismatch=cfg.allow_version_mismatch)
    device, dtype = recompute_precision(cfg, inputs.engine_precisions)
    if (device, dtype) != (cfg.device, cfg.dtype):
        log.info("--device auto: recomputing on %s in %s, as the shards' engines ran", device,
                 dtype)
        cfg = cfg.model_copy(update={"device": device, "dtype": dtype})
    t0 = time.perf_counter()
    train_logprobs = recompute_logprobs(
        cfg.weights, list(cfg.rollouts), max_tokens_per_microbatch=cfg.max_tokens_per_microbatch,
        deterministic=cfg.deterministic, dtype=cfg.dtype,
        global_batch_size=cfg.global_batch_size, device=cfg.device, backend=cfg.backend)
    recompute_s = time.perf_counter() - t0
    numbers = compare(inputs.samples, train_logprobs, tol=cfg.tol, num_worst=cfg.num_worst)
    log.info("%s = %.3g over %d samples (max %.3g); tol %g", METRIC, numbers["metric"],
             len(inputs.samples), numbers["max_abs_diff"], cfg.tol)
    layers = None
    if cfg.layerwise:
        from rltool.align.layerwise import compare_layers

        assert cfg.engine is not None  # the config validator requires it
        chosen = [inputs.samples[i] for i in numbers["order"][:cfg.layerwise_samples]]
        layers = compare_layers(chosen, model_dir=inputs.model_dir, engine_url=cfg.engine,
                                dtype=cfg.dtype, tol=cfg.effective_layer_tol,
                                api_key=cfg.api_key, timeout_s=cfg.timeout_s, device=cfg.device)
    result = GateResult(
        metric=numbers["metric"], max_abs_diff=numbers["max_abs_diff"], tol=cfg.tol,
        passed=numbers["passed"], num_samples=len(inputs.samples),
        num_masked_tokens=numbers["num_masked_tokens"], histogram=numbers["histogram"],
        worst_samples=numbers["worst_samples"], worst_positions=numbers["worst_positions"],
        weights_version=inputs.weights_version, shard_versions=inputs.shard_versions,
        recompute_s=recompute_s, layerwise=layers,
        config=cfg.model_dump(mode="json", exclude_none=True, exclude={"api_key"}))
    if cfg.report:
        write_report(result, cfg)
    return result


def write_report(result: GateResult, cfg: AlignGateConfig) -> None:
    """The result as JSON at cfg.report and the resolved config next to it (both atomic)."""
    from rltool import atomic
    from rltool.config import write_resolved

    assert cfg.report is not None
    path = Path(cfg.report)
    atomic.write_json(path, result.to_dict())
    write_resolved(cfg, path.with_name(path.stem + ".config.toml"))
