"""INT4 (W4A16) rollout on a CUDA GPU: the compiled W4A16 GEMM at Qwen2.5-0.5B's shapes against
the float64 product of the dequantized weights, and an INT4 checkpoint served with its linears
kept INT4 (CUDA-graph decode for the dense model) against the same checkpoint dequantized.

Every test skips when `torch.cuda.is_available()` is false."""

from __future__ import annotations

import pytest
import torch

from rltool.convert import int4
from rltool.convert.fp8 import DequantConfig
from rltool.engine.paged_runner import PagedRunner
from tests.engine.test_int4_gemm import resident

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19, 25, 6, 13, 1, 28, 12, 15, 20]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m", [1, 5, 64, 256, 2048])
def test_int4_gemm_at_qwen_0_5b_shapes(m, symmetric):
    """qkv (with its bias), o, gate_up and down of Qwen2.5-0.5B, bf16 activations, groups of 128
    and 32: within bf16's rounding of the output plus float32 accumulation of the float64
    product of the dequantized weights; a zero point or scale off by one group is outside."""
    from rltool.engine.int4_gemm import int4_linear

    torch.manual_seed(m)
    for (n, k), group in zip([(1152, 896), (896, 896), (9728, 896), (896, 4864)],
                             [128, 32, 128, 32]):
        w = torch.randn(n, k, device="cuda") * 0.02
        t = int4.quantize_int4(w, group_size=group, symmetric=symmetric)
        weight = resident(t, "cuda")
        x = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16) if n == 1152 else None
        got = int4_linear(x, weight, bias).double()
        deq = int4.dequantize_int4(t, dtype=torch.bfloat16).double()
        exact = x.double() @ deq.T + (0 if bias is None else bias.double())
        bound = (torch.finfo(torch.bfloat16).eps * exact.abs()
                 + k * torch.finfo(torch.float32).eps * (x.double().abs() @ deq.abs().T) + 1e-6)
        used = ((got - exact).abs() / bound).max().item()
        print(f"m={m} n={n} k={k} g={group} symmetric={symmetric}: max |err| / bound = {used:.3g}")
        assert used <= 1, (n, k)
        weight.scale.copy_(weight.scale.roll(1, dims=1))
        wrong = int4_linear(x, weight, bias).double()
        assert ((wrong - exact).abs() > bound).any()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_int4_checkpoint_served_on_cuda_matches_dequantized(arch, tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory(arch, 0)
    q, d = tmp_path / "int4", tmp_path / "deq"
    int4.quantize_checkpoint(int4.Int4Config(hf=model_dir, out=q, group_size=16, workers=1,
                                             symmetric=arch == "qwen2"))
    int4.dequantize_checkpoint(DequantConfig(hf=q, out=d, dtype="bf16", workers=1))
    runners = [PagedRunner(p, device="cuda", dtype="bf16", max_running=8, page_size=4,
                           max_total_tokens=4096, cuda_graph_max_bs=8) for p in (d, q)]
    info = runners[1].weight_info
    assert info["weight_precision"] == "int4" and info["weight_dtype"] == "int4"
    assert info["quantization"]["resident"] == "int4"
    assert runners[1].model.nbytes() < runners[0].model.nbytes()
    outs = []
    for r in runners:
        rows = [r.full_pass_logits(SEQ, start=1)[-1:].float()]
        rows.append(r.prefill([("a", SEQ[:12], 0)], want=[True]).float())
        for t in range(12, len(SEQ)):  # graph-replayed decode steps (dense model)
            rows.append(r.decode(["a"], [SEQ[t]]).float())
        outs.append(torch.log_softmax(torch.cat(rows), -1))
    diff = (outs[0] - outs[1]).abs().max().item()
    print(f"{arch}: max |logprob(int4 resident) - logprob(dequantized)| = {diff:.4f}")
    assert diff < 0.05  # the same weights; bf16 GEMM outputs accumulated in another order
