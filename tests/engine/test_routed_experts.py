"""`return_routed_experts` on /generate (rollout routing replay): the engine reports, for every
token whose KV it computed, the experts each MoE layer routed it to, in SGLang's layout, and
these are the experts transformers' Qwen3MoeForCausalLM routes the same sequence to."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from rltool.engine.app import EngineState, build_app
from rltool.engine.config import ServeConfig
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler

# The second prompt shares ten tokens with the first: two cached pages of 4 and a copy of two
# tokens of the third (copy-on-write).
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 40],
           [3, 4]]


def hf_routes(model_dir, ids):
    """transformers' top-k experts [T, layers, k] of one sequence."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return np.stack([torch.softmax(r.float(), -1).topk(k, -1).indices.numpy()
                     for r in out.router_logits], axis=1)


@pytest.fixture(scope="module")
def client(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3_moe", 0)
    # Pages of 4 and prefill chunks of 4: routes come from chunked prefill, a reused cached
    # prefix (full pages and a copied partial one) and batched decode steps.
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=4, page_size=4,
                         max_total_tokens=256)
    sched = PagedScheduler(runner, max_running=4, max_prefill_tokens=8, chunked_prefill_size=4)
    sched.start()
    cfg = ServeConfig(model=model_dir)
    yield TestClient(build_app(EngineState(cfg=cfg, runner=runner, scheduler=sched,
                                           started=time.monotonic()))), model_dir
    sched.stop()


def test_routed_experts_match_transformers(client):
    http, model_dir = client
    new = 6
    body = {"input_ids": PROMPTS, "return_routed_experts": [True, True, False],
            "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}
    first = http.post("/generate", json={**body, "input_ids": PROMPTS[0],
                                         "return_routed_experts": True}).json()
    outs = [first] + http.post("/generate", json={**body, "input_ids": PROMPTS[1:],
                                                  "return_routed_experts": [True, False]}).json()
    assert "routed_experts" not in outs[2]["meta_info"]
    for prompt, out in zip(PROMPTS[:2], outs[:2]):
        ids = prompt + out["output_ids"]
        raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype="<i4")
        got = raw.reshape(len(ids) - 1, 2, 2)  # tiny qwen3_moe: 2 MoE layers, top-2
        np.testing.assert_array_equal(got, hf_routes(model_dir, ids)[:-1])
    assert outs[1]["meta_info"]["cached_tokens"] == 10  # the routes of a reused prefix


def test_routed_experts_refused_for_a_dense_model():
    from rltool.engine.api import GenerateInput
    from rltool.engine.expand import expand_generate
    from rltool.errors import BadInputError

    with pytest.raises(BadInputError, match="needs an MoE model"):
        expand_generate(GenerateInput(input_ids=[1, 2], return_routed_experts=True),
                        tokenizer=None, context_length=4096, vocab_size=100, max_requests=4096,
                        deterministic=False)
