"""FP8 rollout on a CUDA GPU: the block-FP8 GEMM at Qwen2.5-0.5B's shapes against its float64
reference and within the analytic bound of the dequantized-weight product; a block-FP8 checkpoint
served with its linears kept in FP8 against the bf16 model it came from; the FP8 KV cache
through CUDA-graph decode against the bf16 cache.

Every test skips only when `torch.cuda.is_available()` is false."""

from __future__ import annotations

import pytest
import torch

from rltool.convert.fp8 import Fp8Config, quantize_blocks_torch, quantize_checkpoint
from rltool.engine.paged_runner import PagedRunner
from tests.engine.test_fp8_kv import KV_TOL, paged_logprobs
from tests.engine.test_triton_kernels import activation_error_bound, fp8_linear_float64

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19, 25, 6, 13, 1, 28, 12, 15, 20]
# Measured on CPU (fp32, Triton's interpreter) for the tiny models: 0.029-0.039 nats between the
# FP8-resident model and the unquantized one; bf16 adds up to 0.02 (tests/gpu/test_gpu_engine.py).
FP8_WEIGHT_TOL = 0.15


@pytest.mark.parametrize("m", [1, 64, 256, 2048])
def test_fp8_gemm_at_qwen_0_5b_shapes(m):
    """qkv, o, gate_up and down of Qwen2.5-0.5B, bf16 activations: the kernel equals the float64
    reference of its quantized math to bf16 output rounding, and the exact product with the
    dequantized weight within the bound that activation rounding allows."""
    from rltool.engine.fp8_gemm import fp8_linear

    torch.manual_seed(m)
    for n, k in [(1152, 896), (896, 896), (9728, 896), (896, 4864)]:
        w = torch.randn(n, k, device="cuda") * 0.02
        q, block_scale = quantize_blocks_torch(w, (128, 128))
        scale = block_scale.to("cuda").repeat_interleave(128, dim=0)[:n].contiguous()
        x = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)
        got = fp8_linear(x, q, scale, block_k=128).double()
        want = fp8_linear_float64(x, q, scale, 128)
        assert ((got - want).abs() <= 2 ** -8 * want.abs() + 1e-4 * want.abs().max()).all()
        deq = q.double() * scale.double().repeat_interleave(128, dim=1)[:, :k]
        bound = activation_error_bound(x, deq, 128)
        rounding = 2 ** -8 * (x.double() @ deq.T).abs()  # the bf16 output
        assert ((got - x.double() @ deq.T).abs() <= bound + rounding + 1e-4).all(), (n, k)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_fp8_checkpoint_served_on_cuda_is_close_to_bf16(arch, tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory(arch, 0)
    quantize_checkpoint(Fp8Config(hf=model_dir, out=tmp_path / "fp8", block=(32, 32),
                                  workers=1))
    runners = [PagedRunner(d, device="cuda", dtype="bf16", max_running=8, page_size=4,
                           max_total_tokens=4096, cuda_graph_max_bs=8)
               for d in (model_dir, tmp_path / "fp8")]
    assert runners[1].weight_info["weight_dtype"] == "fp8_e4m3"
    assert runners[1].weight_info["quantization"]["resident"] == "fp8"
    assert runners[1].model.nbytes() < runners[0].model.nbytes()
    outs = []
    for r in runners:
        rows = [r.full_pass_logits(SEQ, start=1)[-1:].float()]
        rows.append(r.prefill([("a", SEQ[:12], 0)], want=[True]).float())
        for t in range(12, len(SEQ)):  # graph-replayed decode steps
            rows.append(r.decode(["a"], [SEQ[t]]).float())
        outs.append(torch.log_softmax(torch.cat(rows), -1))
    diff = (outs[0] - outs[1]).abs().max().item()
    print(f"{arch}: max |logprob(fp8 weights) - logprob(bf16)| = {diff:.4f}")
    assert 0 < diff < FP8_WEIGHT_TOL


def test_fp8_kv_decode_on_cuda(tiny_model_factory):
    """The FP8 KV cache through the fused cache write, the Triton decode kernel and CUDA-graph
    replay: within the CPU test's tolerance of the bf16 cache."""
    model_dir = tiny_model_factory("qwen2", 0)
    ref = paged_logprobs(model_dir, "bf16", "auto", device="cuda")
    got = paged_logprobs(model_dir, "bf16", "fp8_e4m3", device="cuda")
    diff = (got - ref).abs().max().item()
    print(f"max |logprob(fp8 KV) - logprob(bf16 KV)| = {diff:.4f}")
    assert 0 < diff < KV_TOL
