"""The backuper's SSD tier refuses a snapshot file it did not write, however self-consistent."""

from __future__ import annotations

import os

import pytest
import torch

from rltool.errors import CheckpointError
from rltool.train.backuper import WeightBackuper, module_tensors
from rltool.train.snapshot_file import MappedSnapshot, write_snapshot
from tests.train.test_backuper import _assert_bitequal, _model, _scramble, _state

pytestmark = pytest.mark.timeout(120)


def _layout(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def test_a_substituted_self_consistent_snapshot_is_refused(tmp_path):
    """Bug: the SSD tier checked only the file's own header checksum, so anyone who could write
    to ssd_dir could put another valid snapshot (other weights, a header checksum of its own) in
    place of a tag's file and restore() loaded it. The backuper now keeps the checksum it wrote
    and refuses the file, on every path that reads it, leaving the live weights as they were."""
    model = _model()
    b = WeightBackuper(module_tensors(model), ssd_dir=tmp_path, host_budget_bytes=0,
                       stage_on_device=True)
    b.backup("ref")
    b.copy("ref", "ref2")
    assert b.tiers("ref") == {"ssd", "live"}
    other = {n: t.detach().clone() for n, t in module_tensors(_model(seed=1)).items()}
    forged = tmp_path / "forged.tmp"
    write_snapshot(forged, other.items(), layout=_layout(other))
    with MappedSnapshot(forged) as snap:  # valid on its own
        assert torch.equal(next(iter(snap.tensors.values())), next(iter(other.values())))
    for tag in ("ref", "ref2"):
        os.replace(forged, tmp_path / f"{tag}.safetensors")
        write_snapshot(forged, other.items(), layout=_layout(other))
    _scramble(model, 3)
    live = _state(model)
    for tag in ("ref", "ref2"):
        with pytest.raises(CheckpointError, match="was replaced"):
            b.restore(tag)
        _assert_bitequal(model, live)
    with pytest.raises(CheckpointError, match="was replaced"):
        b.prefetch("ref").result()  # staging reads the file too
    with pytest.raises(CheckpointError, match="was replaced"):
        b.restore("ref")
    _assert_bitequal(model, live)
    b.close()


def test_a_snapshot_with_tensor_names_swapped_is_refused(tmp_path):
    """Bug: the checksum covers the data section only, so a header naming two same-shaped
    tensors the other way round (the data bytes, and so the checksum, unchanged) passed the
    check and restored each tensor into the other's place. The backuper compares the file's
    layout with the one it wrote."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False),
                                torch.nn.Linear(8, 8, bias=False))
    b = WeightBackuper(module_tensors(model), ssd_dir=tmp_path, host_budget_bytes=0)
    b.backup("ref")
    tensors = {n: t.detach().clone() for n, t in module_tensors(model).items()}
    (a, ta), (c, tc) = tensors.items()
    swapped = tmp_path / "swapped.tmp"
    # The same bytes in the same order, under each other's names.
    checksum = write_snapshot(swapped, [(c, ta), (a, tc)],
                              layout=[(c, ta.dtype, tuple(ta.shape)),
                                      (a, tc.dtype, tuple(tc.shape))])
    path = tmp_path / "ref.safetensors"
    assert checksum == MappedSnapshot(path).checksum
    os.replace(swapped, path)
    _scramble(model, 3)
    live = _state(model)
    with pytest.raises(CheckpointError, match="order, dtypes or shapes differ"):
        b.restore("ref")
    _assert_bitequal(model, live)
    b.close()
