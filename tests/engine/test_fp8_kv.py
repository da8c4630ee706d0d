"""`--kv-cache-dtype fp8_e4m3` on CPU: paged prefill (continued chunks read the FP8 cache) and
decode give log-probabilities within a measured tolerance of the model-dtype cache; the pool's
bytes per token and capacity; what /get_server_info and /get_model_info report."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rltool.engine import api
from rltool.engine.config import ServeConfig
from rltool.engine.paged import KVPool
from rltool.engine.paged_runner import PagedRunner
from tests.helpers.engines import serve_app

SEQ = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19, 25, 6, 13, 1, 28, 12]
# Measured max |logprob difference| over these sequences: 0.005 (fp32) to 0.013 (bf16) nats (three
# families); the bound leaves ~4x room.
KV_TOL = 0.05


def paged_logprobs(model_dir, dtype: str, kv_cache_dtype: str, *,
                   device: str = "cpu") -> torch.Tensor:
    """Teacher-forced log-probabilities from a paged prefill in two chunks (the second reads the
    first from the cache) next to another request, then decode steps over the cache."""
    r = PagedRunner(model_dir, device=device, dtype=dtype, max_running=4, page_size=4,
                    max_total_tokens=256, kv_cache_dtype=kv_cache_dtype, cuda_graph_max_bs=4)
    r.prefill([("a", SEQ[:6], 0), ("b", SEQ[3:10], 0)], want=[False, False])
    rows = [r.prefill([("a", SEQ[6:9], 6)], want=[True])]
    for t in range(9, len(SEQ)):
        rows.append(r.decode(["a", "b"], [SEQ[t], SEQ[t]])[:1])
    return torch.log_softmax(torch.cat(rows).float(), dim=-1)


@pytest.mark.parametrize("arch,dtype", [("qwen2", "fp32"), ("qwen3", "bf16"), ("llama", "fp32")])
def test_fp8_kv_logprobs_are_close_to_model_dtype_kv(tiny_model_factory, arch, dtype):
    model_dir = tiny_model_factory(arch, 0)
    ref = paged_logprobs(model_dir, dtype, "auto")
    got = paged_logprobs(model_dir, dtype, "fp8_e4m3")
    diff = (got - ref).abs().max().item()
    assert 0 < diff < KV_TOL, diff


def test_fp8_kv_pool_holds_about_twice_the_tokens_of_bf16():
    """Bytes per token: 2 x layers x KV heads x (head_dim + 4) against x (2 x head_dim), so a
    memory budget holds 2 x 128 / 132 = 1.94x the tokens at head_dim 128 (the float32 scales)."""
    shape = SimpleNamespace(num_layers=24, num_kv_heads=2, head_dim=128)
    bf16 = KVPool.bytes_per_token(shape, dtype=torch.bfloat16, kv_cache_dtype="auto")
    fp8 = KVPool.bytes_per_token(shape, dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    assert (bf16, fp8) == (24 * 2 * 2 * 128 * 2, 24 * 2 * 2 * 132)
    budget = 8 << 30
    assert (budget // fp8) / (budget // bf16) == pytest.approx(256 / 132, rel=1e-6)
    pool = KVPool(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=16,
                  dtype=torch.bfloat16, device="cpu", kv_cache_dtype="fp8_e4m3")
    per_token = KVPool.bytes_per_token(SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16),
                                       dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    assert pool.nbytes() == 8 * 4 * per_token and pool.k.dtype == torch.float8_e4m3fn


def test_server_info_reports_kv_and_weight_precision(tiny_model_dir):
    cfg = ServeConfig(model=tiny_model_dir, device="cpu", kv_cache_dtype="fp8_e4m3",
                      max_running_requests=4)
    with serve_app(cfg) as (client, runner):
        info = client.get(api.SERVER_INFO).json()
        model = client.get(api.MODEL_INFO).json()
        out = client.post(api.GENERATE, json={
            "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3,
                                                        "temperature": 0.0}}).json()
    s = runner.spec
    assert info["kv_cache_dtype"] == "fp8_e4m3"
    assert info["kv_bytes_per_token"] == 2 * s.num_layers * s.num_kv_heads * (s.head_dim + 4)
    assert info["kv_pool_tokens"] == runner.max_total_num_tokens > 0
    assert info["weight_dtype"] == model["weight_dtype"] == "fp32"
    assert info["quantization"] is model["quantization"] is None
    assert len(out["output_ids"]) == 3

