"""The arrival patterns of benchmarks/engine_arrivals.py (also the GPU compile test's workload):
twenty patterns of 1 to 64 requests with prompts of 17 to 1500 tokens, the same shapes for every
seed, cached prefixes shared by the patterns that should find them, and the benchmark's flags."""

from __future__ import annotations

import pytest

from benchmarks.engine_arrivals import ARRIVAL_PATTERNS, arrival_patterns, main


def test_patterns_span_the_sizes_and_lengths_with_seeded_ids():
    first, second = arrival_patterns(1000, seed=1), arrival_patterns(1000, seed=2)
    assert len(first) == ARRIVAL_PATTERNS == 20
    sizes = [sum(len(w) for w in p) for p in first]
    assert min(sizes) == 1 and max(sizes) == 64
    lengths = [len(q) for p in first for w in p for q in w]
    assert 17 <= min(lengths) < 40 and 1200 < max(lengths) <= 1500
    assert all(100 <= t < 900 for p in first for w in p for q in w for t in q)
    shape = [[[len(q) for q in w] for w in p] for p in first]
    assert shape == [[[len(q) for q in w] for w in p] for p in second]
    assert first != second
    assert any(len(p) > 1 for p in first)  # some patterns arrive in waves


def test_prefixed_patterns_share_their_prefix():
    """Patterns 4k+2 and 4k+3 start every prompt with the same prefix; 4k and 4k+1 do not."""
    patterns = arrival_patterns(1000, seed=1)
    for k in range(0, ARRIVAL_PATTERNS, 4):
        prefix = patterns[k + 2][0][0][:100]
        for i in (k + 2, k + 3):
            assert all(q[:100] == prefix for w in patterns[i] for q in w)
        plain = [q[:100] for w in patterns[k + 1] for q in w]
        assert len(set(map(tuple, plain))) == len(plain)


@pytest.mark.parametrize("argv", [["--arm", "varlen"], ["--new-tokens", "0"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_no_gpu_is_one_line_and_exit_2(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["Error: engine_arrivals runs on a CUDA GPU and none is visible; run it on a "
                   "GPU host"]
