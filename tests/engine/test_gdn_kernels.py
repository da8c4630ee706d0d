"""The Gated DeltaNet Triton kernels (rltool.engine.gdn_kernels, gdn_prefill) against the torch
reference of rltool.engine.linear_attention in float32: packed prefill of sequences of different lengths (one
token, under and over a chunk, several chunks) from fresh and stored states, decode steps by slot,
bf16 state storage, the gated RMS norm, and the tiny hybrid served through them against
transformers. Compiled on a CUDA machine, elsewhere run by Triton's interpreter on CPU in a child
process started with TRITON_INTERPRET=1 (see tests/helpers/triton_child.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import triton_child
from tests.helpers.gdn import (random_layer, random_states, reference_decode, reference_prefill,
                               spec_of)
from tests.helpers.triton_child import ran_in_child

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHILD = "RLTOOL_GDN_INTERPRET_CHILD"
SPEC = spec_of(k_heads=1, v_heads=2, k_dim=16, v_dim=16)  # value heads share a key head
# (offset, length, slot, fresh): 1 token, under a chunk, exactly one, one and a bit, two
SEGMENTS = [(0, 1, 3, False), (1, 5, 1, True), (6, 64, 7, False), (70, 70, 5, False),
            (140, 80, 2, True)]


@pytest.fixture(scope="module")
def child_report(tmp_path_factory) -> dict[str, str] | None:
    return triton_child.child_report(__file__, CHILD, tmp_path_factory.mktemp("gdn-child"), 600)


def close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Within `tol` of the reference, relative to its largest entry past 1."""
    ref = ref.float().cpu()
    err = (got.float().cpu() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), (err, tol)


def test_prefill_matches_the_reference_from_stored_and_fresh_states(request):
    """Outputs, final recurrent states and conv states of every sequence within 1e-4; the slots
    of no sequence untouched."""
    if ran_in_child(request):
        return
    from rltool.engine import gdn_prefill

    gen = torch.Generator().manual_seed(1)
    layer = random_layer(SPEC, 220, gen=gen, device=DEV)
    conv, ssm = random_states(SPEC, 8, gen=gen, device=DEV)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    o = gdn_prefill.prefill(layer, conv, ssm, gdn_prefill.PrefillPlan.of(SEGMENTS, DEV))
    ref = reference_prefill(layer, conv_ref, ssm_ref, SEGMENTS)
    assert o.dtype == torch.float32 and o.shape == (220, 2, 16)
    close(o, ref, 1e-4)
    close(conv, conv_ref, 1e-6)
    close(ssm, ssm_ref, 1e-4)
    untouched = [0, 4, 6, 8]
    assert torch.equal(ssm[untouched], ssm_ref[untouched])
    # a kernel that ignored the stored states would miss by far more than the tolerance
    assert (ref[:1] - reference_prefill(layer, None, None, SEGMENTS[:1])).abs().max() > 1e-2


def test_prefill_without_a_pool_starts_from_zeros(request):
    """A pass beside the pool (no conv or recurrent state): every sequence from zeros."""
    if ran_in_child(request):
        return
    from rltool.engine import gdn_prefill

    gen = torch.Generator().manual_seed(2)
    layer = random_layer(SPEC, 100, gen=gen, device=DEV)
    segments = [(0, 67, 0, True), (67, 33, 0, True)]
    close(gdn_prefill.prefill(layer, None, None, gdn_prefill.PrefillPlan.of(segments, DEV)),
          reference_prefill(layer, None, None, segments), 1e-4)


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_update_the_states_at_their_slots(request, ssm_dtype):
    """Three steps of a batch whose rows hold slots out of order, plus a padded row on the
    scratch slot 0: outputs within 1e-4 of the reference and every real slot's states too."""
    if ran_in_child(request):
        return
    from rltool.engine import gdn_kernels

    gen = torch.Generator().manual_seed(3)
    conv, ssm = random_states(SPEC, 8, gen=gen, ssm_dtype=ssm_dtype, device=DEV)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    slots = torch.tensor([3, 1, 7, 5, 2, 0], device=DEV)
    for _ in range(3):
        layer = random_layer(SPEC, 6, gen=gen, device=DEV)
        o = gdn_kernels.decode(layer, conv, ssm, slots)
        ref = reference_decode(layer, conv_ref, ssm_ref, slots)
        # bf16 storage: a state rounded the other way moves an output by its last bit
        close(o[:5], ref[:5], 1e-4 if ssm_dtype == torch.float32 else 2e-3)
    real = [1, 2, 3, 5, 7]
    close(conv[real], conv_ref[real], 1e-6)
    # bf16: the two paths may round an entry apart, then carry it (a few bf16 ulps)
    close(ssm[real], ssm_ref[real], 1e-4 if ssm_dtype == torch.float32 else 3e-2)
    assert torch.equal(ssm[[4, 6, 8]], ssm_ref[[4, 6, 8]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_matches_the_reference(request, dtype):
    """The output's RMS norm per head times SiLU(z) in one kernel against
    linear_attention.gated_rms_norm: float32 within 1e-5; bf16 within a few of its ulps (the
    same roundings, the float32 sums in another order)."""
    if ran_in_child(request):
        return
    from rltool.engine import gdn_kernels
    from rltool.engine.linear_attention import gated_rms_norm

    gen = torch.Generator().manual_seed(4)
    layer = random_layer(SPEC, 37, gen=gen, dtype=dtype, device=DEV)
    o = torch.randn(37, 2, 16, generator=gen).to(dtype).to(DEV)
    weight = (1 + 0.3 * torch.randn(16, generator=gen)).to(dtype).to(DEV)
    z = layer.proj[:, SPEC.conv_dim:SPEC.conv_dim + 32].reshape(37, 2, 16)
    ref = gated_rms_norm(o, z, weight, 1e-6).reshape(37, 32)
    got = gdn_kernels.gated_norm(layer, o, weight, 1e-6)
    assert got.dtype == dtype and got.shape == (37, 32)
    close(got, ref, 1e-5 if dtype == torch.float32 else 2e-2)


def test_tiny_hybrid_through_the_kernels_matches_transformers(request, tmp_path):
    """The runner's prefill in chunks of at most 5 tokens (continuing states, several requests
    per packed pass) then decode steps, with HybridLM's GDN layers on the kernels: every logit
    row within 1e-4 of transformers' on the whole sequence."""
    if ran_in_child(request):
        return
    from transformers import AutoModelForCausalLM

    from rltool.engine.paged_runner import PagedRunner
    from tests.helpers.hybrid import make_hybrid, prefill_in_chunks

    model_dir = make_hybrid(tmp_path / "m", task=None)
    seqs = [[3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19], [4, 4, 9, 1, 2, 14, 20, 21, 5]]
    prompt = [8, 5]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [hf(input_ids=torch.tensor([s])).logits[0] for s in seqs]
    runner = PagedRunner(model_dir, device=DEV, dtype="fp32", max_running=4, page_size=4,
                         max_total_tokens=256, prefix_cache=False, disable_cuda_graph=True)
    assert runner.model.gdn_kernels and runner.model.fused
    for i, row in enumerate(prefill_in_chunks(runner, seqs, prompt, chunk=5)):
        close(row, refs[i][prompt[i] - 1], 1e-4)
    for t in range(3):
        logits = runner.decode(["r0", "r1"], [seqs[i][prompt[i] + t] for i in range(2)])
        for i in range(2):
            close(logits[i], refs[i][prompt[i] + t], 1e-4)
