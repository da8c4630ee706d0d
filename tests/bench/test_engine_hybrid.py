"""benchmarks/engine_hybrid.py's refusals: bad input gets a one-line error and exit 2 before any
checkpoint is written (its runs need a GPU, or the Triton interpreter for the --quick smoke run,
which is too slow for the suite: docs/benchmarks.md)."""

from __future__ import annotations

import os

import pytest

from benchmarks import engine_hybrid


@pytest.mark.parametrize("argv, message", [
    (["--batches", "64,x"], "--batches '64,x': give comma-separated integers"),
    (["--batches", "0"], "--batches: give at least one batch size >= 1"),
    (["--device", "cpu"], "--device cpu runs only --quick under TRITON_INTERPRET=1"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        engine_hybrid.main(argv + ["--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == []


def test_cuda_is_refused_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        assert engine_hybrid.parse([]).device == "cuda"
        return
    with pytest.raises(SystemExit) as exit_info:
        engine_hybrid.main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
