"""The engine's POST /debug/hidden_states (mounted by --enable-debug-endpoints)."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM


def test_hidden_states_match_a_plain_forward(align_engine, tiny_model_dir):
    ids = [5, 9, 11, 7, 3]
    r = httpx.post(align_engine.url + "/debug/hidden_states", json={"input_ids": ids}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True)
    assert len(body["hidden_states"]) == model.config.num_hidden_layers + 1
    for got, want in zip(body["hidden_states"], out.hidden_states):
        assert torch.equal(torch.tensor(got, dtype=torch.float32), want[0])
    # token logprobs at temperature 1, float64 reference from the same logits
    logits = out.logits[0, :-1].double()
    ref = [float(torch.log_softmax(logits[t], -1)[ids[t + 1]]) for t in range(len(ids) - 1)]
    assert body["token_logprobs"] == pytest.approx(ref, abs=1e-6)
    assert body["num_tokens"] == len(ids) and body["dtype"] == "fp32"


def test_bad_requests_are_400(align_engine):
    url = align_engine.url + "/debug/hidden_states"
    assert httpx.post(url, json={"input_ids": [1]}, timeout=30).status_code == 400
    assert httpx.post(url, json={"input_ids": [1, 10 ** 6]}, timeout=30).status_code == 400
    assert httpx.post(url, json={"ids": [1, 2]}, timeout=30).status_code == 400


def test_off_by_default(builtin_engine):
    r = httpx.post(builtin_engine.url + "/debug/hidden_states", json={"input_ids": [1, 2]},
                   timeout=30)
    assert r.status_code == 404
