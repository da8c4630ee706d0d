"""Shared pieces of the quantized-sync tests (tests/delta/test_fp8_sync.py, test_int4_sync.py):
trainer states, the offline conversion of their checkpoints, a CPU engine, and the publish of
versions 1 (full) and 2 (delta) checked against those conversions."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from rltool.delta.config import SyncConfig
from rltool.delta.publish import publish_version
from rltool.delta.pull import pull_weights
from rltool.engine.paged_runner import PagedRunner
from rltool.io.checkpoint import is_delta_dir
from rltool.io.hf_dir import write_hf_dir
from rltool.rundir import VERSION_FILE

SEQ = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19]


def trained(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A training step's weights: fp32, a small update on a fraction of the entries."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in base.items():
        t = t.float()
        mask = torch.rand(t.shape, generator=g) < 0.3
        out[name] = t + mask * torch.randn(t.shape, generator=g) * 1e-2
    return out


def runner(path, dtype="bf16") -> PagedRunner:
    return PagedRunner(path, device="cpu", dtype=dtype, max_running=2, page_size=4,
                       max_total_tokens=64)


def logits(path, dtype="bf16") -> torch.Tensor:
    return runner(path, dtype).full_pass_logits(SEQ, start=1)


def converted_versions(base: Path, root: Path, convert: Callable[[Path, Path], object]
                       ) -> tuple[dict, dict]:
    """(trainer states of versions 1 and 2, `convert(hf, out)` of each trainer checkpoint
    written in bf16)."""
    states = {1: trained(load_file(str(base / "model.safetensors")), 1)}
    states[2] = trained(states[1], 2)
    refs = {}
    for v, state in states.items():
        (root / f"ckpt{v}").mkdir()
        write_hf_dir(root / f"ckpt{v}", state, source_model_dir=base, dtype="bf16")
        convert(root / f"ckpt{v}", root / f"ref{v}")
        refs[v] = root / f"ref{v}"
    return states, refs


def publish_full_and_delta(base: Path, states: dict, refs: dict, tmp_path: Path, precision: str,
                           assert_same: Callable[[Path, Path], None]) -> tuple[Path, Path, Path]:
    """Publish version 1 (full) and 2 (delta) at `precision`, pull version 2; each checked with
    `assert_same` against its conversion -> (version 1, version 2, the pulled version 2)."""
    sync = SyncConfig(sync="delta", precision=precision, full_every=10)
    pub = tmp_path / "weights"
    metrics = {v: publish_version(states[v], sync, publish_dir=pub, version=v,
                                  source_model_dir=base, dtype="bf16", workers=1)
               for v in (1, 2)}
    v1, v2 = pub / "weight_v000001", pub / "weight_v000002"
    assert metrics[1]["sync/mode"] == "full" and metrics[2]["sync/mode"] == "delta"
    assert is_delta_dir(v2) and not is_delta_dir(v1)
    assert {m["sync/precision"] for m in metrics.values()} == {precision}
    assert json.loads((v1 / VERSION_FILE).read_text()) == {"version": 1, "precision": precision}
    assert_same(v1, refs[1])
    local = tmp_path / "local"
    pull_weights(local_checkpoint_dir=local, source_dir=pub, target_version=2, workers=1)
    assert_same(local, refs[2])  # the delta of the quantized tensors rebuilds exactly
    return v1, v2, local
