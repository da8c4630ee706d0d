"""The tiny qwen3_5 hybrid on a CUDA GPU in deterministic mode: the engine's recomputing full pass
(each GDN layer through transformers' own functions, HybridLM._gdn_as_trainer) against the torch
trainer on the same GPU, through the align gate, in fp32 and bf16; and the Gated DeltaNet Triton
kernels (rltool.engine.gdn_kernels, gdn_prefill) against the torch reference at a real model's layer sizes in
bf16.

Skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_deterministic import served_rollout_gate
from tests.helpers.hybrid import make_hybrid

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hybrid_align_gate_is_exactly_zero_on_the_gpu(dtype, tmp_path):
    """The deterministic CUDA engine (`--deterministic`, driven in this process: the served
    path of the align gate is tests/gpu/test_gpu_deterministic.py's) samples a shard of the
    hybrid through the rollout stage; `align-gate --device auto --deterministic` recomputes with
    the torch trainer on the same GPU in the recorded dtype: every token's logprob equal."""
    result = served_rollout_gate(make_hybrid(tmp_path / "m"), dtype, tmp_path,
                                 max_response_len=80, disable_radix_cache=True, served=False)
    assert result.config["device"] == "cuda" and result.config["dtype"] == dtype
    assert result.num_masked_tokens > 0
    assert result.max_abs_diff == 0.0 and result.passed, result.worst_positions


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_gdn_kernels_match_the_reference_at_real_sizes_in_bf16(ssm_dtype):
    """The Triton GDN kernels at the hybrid-0.7b preset's layer sizes (4 key heads, 8 value
    heads of 128 dims) on bf16 projections and conv states: a packed prefill of a 4k-token
    prompt, prompts continuing stored states and short ones, then decode steps at B=256, against
    the torch reference computed in float32 from the same bf16 inputs; within 3% of the largest
    value (bf16 conv outputs, outputs and states; TF32 products: ~1% at small sizes)."""
    from rltool.engine import gdn_kernels, gdn_prefill
    from tests.helpers.gdn import (random_layer, random_states, reference_decode,
                                   reference_prefill, spec_of)

    spec = spec_of(k_heads=4, v_heads=8, k_dim=128, v_dim=128)
    gen = torch.Generator().manual_seed(0)
    lengths = [4096, 1000, 130, 64, 37, 1]
    segments, off = [], 0
    for i, n in enumerate(lengths):
        segments.append((off, n, 2 * i + 1, i % 2 == 0))
        off += n
    layer = random_layer(spec, off, gen=gen, dtype=torch.bfloat16, device="cuda")
    conv, ssm = random_states(spec, 300, gen=gen, conv_dtype=torch.bfloat16,
                              ssm_dtype=ssm_dtype, device="cuda")
    conv_ref, ssm_ref = conv.clone(), ssm.clone()

    def close(got, ref):
        err = (got.float() - ref.float()).abs().max().item()
        assert err <= 3e-2 * ref.float().abs().max().item(), err

    close(gdn_prefill.prefill(layer, conv, ssm, gdn_prefill.PrefillPlan.of(segments, "cuda")),
          reference_prefill(layer, conv_ref, ssm_ref, segments))
    close(ssm, ssm_ref)
    close(conv, conv_ref)
    slots = torch.randperm(300, generator=gen)[:256].add(1).cuda()
    for _ in range(4):
        layer = random_layer(spec, 256, gen=gen, dtype=torch.bfloat16, device="cuda")
        close(gdn_kernels.decode(layer, conv, ssm, slots),
              reference_decode(layer, conv_ref, ssm_ref, slots))
    close(ssm, ssm_ref)


@pytest.mark.parametrize("deterministic", [False, True])
def test_hybrid_decode_graph_replay_equals_eager(deterministic, tmp_path):
    """The tiny hybrid's decode steps replayed from CUDA graphs equal eager ones bit for bit,
    with the GDN layers on the Triton kernels (reading each row's state slot through the decode
    meta's page-table rows on the device) and, deterministic, on the torch path: the engine's
    own capture against an engine built with `disable_cuda_graph`."""
    from rltool.engine.paged_runner import PagedRunner

    model_dir = make_hybrid(tmp_path / "m", task=None)
    opts = dict(device="cuda", dtype="bf16", max_running=8, page_size=4, max_total_tokens=4096,
                cuda_graph_max_bs=8, prefix_cache=False, deterministic=deterministic)
    graphed = PagedRunner(model_dir, **opts)
    eager = PagedRunner(model_dir, **opts, disable_cuda_graph=True)
    assert graphed.graphs and not eager.graphs
    assert graphed.model.gdn_kernels and graphed.model.fused != deterministic
    seq = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19, 25, 6, 13, 1, 28, 12, 15, 20]
    prompts = {"a": seq[:5], "b": seq[3:14], "c": seq[:1]}
    for r in (graphed, eager):
        r.prefill([(rid, p, 0) for rid, p in prompts.items()], want=[False] * 3)
    for step in range(40):  # crosses page boundaries; rows hold slots 1-3 and padding slot 0
        toks = [(step * 7 + i) % 30 for i in range(3)]
        a = graphed.decode(list(prompts), toks).clone()
        b = eager.decode(list(prompts), toks)
        assert torch.equal(a, b), step
