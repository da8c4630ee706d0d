"""The W4A16 Triton GEMM (rltool.engine.int4_gemm) against a float32 reference of the dequantized
weights, and a model whose linears stay INT4 against the same checkpoint dequantized at load:
compiled on a CUDA machine, elsewhere run by Triton's interpreter on CPU in a child process
started with TRITON_INTERPRET=1 (Triton decides interpreted or compiled for the whole process
when it is first imported, so the child runs this module alone)."""

from __future__ import annotations

import pytest
import torch

from rltool.convert import int4
from tests.helpers import triton_child
from tests.helpers.triton_child import ran_in_child

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
CHILD = "RLTOOL_INT4_INTERPRET_CHILD"


@pytest.fixture(scope="module")
def child_report(tmp_path_factory) -> dict[str, str] | None:
    """Without CUDA: {test name: failure text, "" when it passed} of this module run in a child
    process with TRITON_INTERPRET=1; None on CUDA or in the child."""
    return triton_child.child_report(__file__, CHILD, tmp_path_factory.mktemp("int4-child"), 600)


def resident(t: int4.Int4Tensor, device: str):
    from rltool.engine.int4_weight import Int4Weight

    fmt = int4.Int4Format(group_size=t.group_size, symmetric=t.zero_point is None, ignore=())
    w = Int4Weight.empty(*t.shape, fmt=fmt, device=torch.device(device))
    w.copy_rows(0, t.shape[0], t)
    return w


@pytest.mark.parametrize("symmetric", [True, False])
def test_gemm_matches_dequantized_reference(request, symmetric):
    """Shapes with edges in every tile dimension (M of 1, 5 and 37; N and K not multiples of the
    tiles), groups of 16 and 32, a bias; float32 activations within float32 rounding of the
    float64 product, bf16 ones within bf16's rounding of it."""
    if ran_in_child(request):
        return
    from rltool.engine.int4_gemm import int4_linear

    g = torch.Generator().manual_seed(5)
    for n, k, group in [(48, 64, 16), (80, 96, 32), (16, 32, 32)]:
        w = torch.randn(n, k, generator=g) * 0.1
        t = int4.quantize_int4(w, group_size=group, symmetric=symmetric,
                               scale_dtype=torch.float32)
        weight = resident(t, DEV)
        bias = torch.randn(n, generator=g)
        for m in (1, 5, 37):
            x = torch.randn(m, k, generator=g)
            for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
                deq = int4.dequantize_int4(t, dtype=dtype).double()
                xd = x.to(dtype)
                ref = xd.double() @ deq.T + bias.to(dtype).double()
                y = int4_linear(xd.to(DEV), weight, bias.to(dtype).to(DEV)).cpu()
                assert y.dtype == dtype and y.shape == (m, n)
                err = (y.double() - ref).abs().max().item()
                assert err <= rtol * ref.abs().max().item(), (n, k, group, m, dtype, err)
        # a wrong zero point or scale is caught: shift one group's scale
        if not symmetric:
            weight.zero[0, 0] += 1
            y = int4_linear(x.to(DEV), weight).cpu()
            ref = x.double() @ int4.dequantize_int4(t, dtype=torch.float32).double().T
            assert (y.double() - ref).abs().max().item() > 1e-3


def test_int4_resident_model_matches_dequantized(request, tiny_model_factory, tmp_path):
    """An INT4 checkpoint with its linears kept INT4 (fused q/k/v and gate/up, stacked MoE
    experts, asymmetric groups) against the same checkpoint dequantized at load, in float32:
    the same weights through another GEMM, so logits within float32 rounding."""
    if ran_in_child(request):
        return
    import torch.nn.functional as F

    from rltool.engine.dense_model import LINEAR_KEYS, load_model
    from rltool.engine.int4_weight import Int4Weight

    ids = torch.tensor([3, 9, 4, 17, 22, 5, 8, 30, 11, 2])
    for arch, ignore in [("qwen2", None), ("qwen3_moe", ["lm_head"])]:
        out = tmp_path / arch
        int4.quantize_checkpoint(int4.Int4Config(hf=tiny_model_factory(arch, 0), out=out,
                                                 group_size=16, symmetric=False, ignore=ignore,
                                                 workers=1))
        logits = []
        for keep in (False, True):
            model = load_model(out, device=DEV, dtype=torch.float32, fp8_resident=keep)
            keys = {(i, key) for i, L in enumerate(model.layers) for key in L
                    if key in LINEAR_KEYS}
            assert model.fp8_keys == (keys if keep else set())
            for i, L in enumerate(model.layers):  # the router and norms are never INT4
                assert all(isinstance(t, Int4Weight) == (keep and k in LINEAR_KEYS)
                           for k, t in L.items()), (arch, i)
            pos = torch.arange(len(ids))

            def attend(layer, q, k, v, model=model, pos=pos):
                model.rope_store(q, k, v, pos)
                return F.scaled_dot_product_attention(
                    q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                    enable_gqa=True).transpose(0, 1)

            logits.append(model.logits(model.hidden(ids.to(DEV), attend)).cpu())
        diff = (logits[0] - logits[1]).abs().max().item()
        assert diff < 1e-4, (arch, diff)
