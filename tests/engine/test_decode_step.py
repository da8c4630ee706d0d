"""The decode step's trace span: one `decode.forward` per step's forward, which benchmarks read
for the forward's share of a step."""

from __future__ import annotations

import json
import os

import torch

from rltool import trace
from rltool.engine.paged_runner import PagedRunner


def test_every_decode_step_is_one_decode_forward_span(tiny_model_dir, tmp_path):
    """A single step, the first step of a block and the block's later steps (`decode_next`) are
    one `decode.forward` span each (cat `engine`); a prefill is none."""
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=2, page_size=4)
    trace.configure(tmp_path, role="engine")
    try:
        runner.prefill([("a", [1, 2, 3], 0), ("b", [4, 5], 0)], want=[False, False])
        runner.decode(["a", "b"], [6, 7])
        runner.decode(["a", "b"], [8, 9], steps=3)
        for _ in range(2):
            logits = runner.decode_next(torch.tensor([1, 2]))
    finally:
        trace.configure(None, role="engine")
    assert logits.shape == (2, runner.vocab_size)
    lines = (tmp_path / f"engine-{os.getpid()}.jsonl").read_text().splitlines()
    spans = [e for e in map(json.loads, lines) if e["ph"] == "X"]
    assert [(e["name"], e["cat"]) for e in spans] == [("decode.forward", "engine")] * 4
